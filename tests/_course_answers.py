"""The wrong answers a student can give to the exercises of notebooks 04-09, and what each
notebook's check must say to each (``test_course_exercises_b.py`` runs them): the helper
the notebook imports, borrowed; the weights gathered instead of the outputs; a number
looked up in the notebook's own table; the optimizer state left whole; the loss divided by
the new world size; and the model answer in ``course/solutions/``, which must pass."""

#: notebook -> (how to set up its check, the call that checks an answer, {answer: source}).
#: "solution" is course/solutions/<stem>.py.
EXERCISES = {
    "04_model_parallelism": (
        dict(check_cell="import itertools", names={"MLP"}),
        "check_balance(balance_by_bytes)",
        {
            "borrowed balance_by_cost": "from lightning_par.split import balance_by_cost\n"
            "def balance_by_bytes(layer_bytes, num_stages):\n"
            "    return balance_by_cost(layer_bytes, num_stages)\n",
            "equal layer counts": "def balance_by_bytes(layer_bytes, num_stages):\n"
            "    parts = torch.arange(len(layer_bytes)).tensor_split(num_stages)\n"
            "    return [len(p) for p in parts]\n",
        },
    ),
    "05_pipelining": (
        dict(check_cell="HIDDEN = 16", names=set()),
        "check_interleaved(interleaved_order)",
        {
            "borrowed device_schedule": "from lightning_par.pipeline.schedules import "
            "device_schedule\n"
            "def interleaved_order(device, num_devices, v, chunks):\n"
            "    return device_schedule('interleaved', num_devices, chunks, v)[device]\n",
            "all forwards first": "def interleaved_order(device, num_devices, v, chunks):\n"
            "    stages = [device + c * num_devices for c in range(v)]\n"
            "    fwd = [Step(s, 'fwd', i) for s in stages for i in range(chunks)]\n"
            "    bwd = [Step(s, 'bwd', i) for s in reversed(stages)\n"
            "           for i in reversed(range(chunks))]\n"
            "    return fwd + bwd\n",
        },
    ),
    "06_tensor_and_hybrid": (
        dict(check_cell="import inspect", names=set()),
        "check_column_linear()",
        {
            "weights gathered instead of outputs": """
class GatherWeights(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w, rank, world):
        ctx.rank, ctx.rows = rank, w.shape[0]
        parts = [torch.empty_like(w) for _ in range(world)]
        dist.all_gather(parts, w.contiguous())
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad):
        return grad[ctx.rank * ctx.rows : (ctx.rank + 1) * ctx.rows], None, None


class MyColumnLinear(nn.Module):  # every rank computes the whole output from all the weights
    def __init__(self, linear, rank, world):
        super().__init__()
        rows = torch.arange(linear.out_features).chunk(world)[rank]
        self.weight = nn.Parameter(linear.weight.detach()[rows].clone())
        self.bias = nn.Parameter(linear.bias.detach()[rows].clone())
        self.rank, self.world = rank, world

    def forward(self, x):
        both = torch.cat([self.weight, self.bias[:, None]], 1)
        whole = GatherWeights.apply(both, self.rank, self.world)
        return F.linear(x, whole[:, :-1], whole[:, -1])
""",
            "no allreduce of the input gradient": """
exec(open("course/solutions/06_tensor_and_hybrid.py").read())
AllReduceGrad.backward = staticmethod(lambda ctx, grad: (grad, None))
""",
        },
    ),
    "07_which_strategy": (
        dict(check_cell="import dataclasses", names=set(), whole=("from lightning_par.simulate",)),
        "check_step(my_local_sgd_step_s)",
        {
            "borrowed simulator": "def my_local_sgd_step_s(prof, p, topo, speed):\n"
            "    return scaling_row(prof, p, topo, speed)['step_s']\n",
            "section 5's table looked up": "def my_local_sgd_step_s(prof, p, topo, speed):\n"
            "    return predicted['local_sgd'][p]['step_s']\n",
            "the ring every step": "def my_local_sgd_step_s(prof, p, topo, speed):\n"
            "    link = topo.slowest(p)\n"
            "    ring = 2 * (p - 1) * (link.alpha + link.beta * prof.grad_bytes / p)\n"
            "    return prof.compute_s / speed + ring\n",
        },
    ),
    "08_zero": (
        dict(check_cell="from exercise import checking", names=set()),
        "check_zero_one(MyZeroOne)",
        {
            "optimizer state not sharded": """
class MyZeroOne:  # the two phases make an allreduce; every rank steps every parameter
    def __init__(self, model, make_optimizer, reduce_scatter, all_gather):
        self.params = list(model.parameters())
        self.optimizer = make_optimizer(self.params)
        self.reduce_scatter, self.all_gather = reduce_scatter, all_gather

    def step(self):
        p, n = dist.get_world_size(), sum(q.numel() for q in self.params)
        flat = torch.zeros(p * -(-n // p))
        flat[:n] = torch.cat([q.grad.flatten() for q in self.params])
        self.reduce_scatter(flat)
        self.all_gather(flat)
        start = 0
        for q in self.params:
            q.grad.copy_(flat[start : start + q.numel()].view_as(q) / p)
            start += q.numel()
        self.optimizer.step()
""",
            "optimizer over the whole flat vector": """
exec(open("course/solutions/08_zero.py").read())
_Sliced = MyZeroOne


class MyZeroOne(_Sliced):  # state for p * S elements, the gradient zero outside the slice
    def __init__(self, model, make_optimizer, reduce_scatter, all_gather):
        super().__init__(model, lambda params: None, reduce_scatter, all_gather)
        self.whole = nn.Parameter(self._flat([q.detach() for q in self.params]))
        self.optimizer = make_optimizer([self.whole])

    def step(self):
        mine = self.reduce_scatter(self._flat([q.grad for q in self.params]))
        self.whole.grad = torch.zeros_like(self.whole)
        self.whole.grad[self.lo : self.lo + self.size] = mine / self.world_size
        self.optimizer.step()
        self.slice.data = self.whole.detach()[self.lo : self.lo + self.size].clone()
        weights = torch.zeros(self.world_size * self.size)
        weights[self.lo : self.lo + self.size] = self.slice.detach()
        self.all_gather(weights)
        start = 0
        with torch.no_grad():
            for q in self.params:
                q.copy_(weights[start : start + q.numel()].view_as(q))
                start += q.numel()
""",
            "all-gather forgotten": """
exec(open("course/solutions/08_zero.py").read())
_Answer = MyZeroOne
MyZeroOne = lambda model, make, rs, ag: _Answer(model, make, rs, lambda flat: flat)
""",
            "the sum taken as the mean (no 1/p)": """
exec(open("course/solutions/08_zero.py").read())
_Answer = MyZeroOne
MyZeroOne = lambda model, make, rs, ag: _Answer(
    model, make, lambda flat: rs(flat).mul_(dist.get_world_size()), ag)
""",
            "borrowed FlatUnit": """
from torch import nn

from lightning_par.zero.units import FlatUnit


class MyZeroOne:  # the library's flat unit lays out and shards the parameters
    def __init__(self, model, make_optimizer, reduce_scatter, all_gather):
        self.params = list(model.parameters())
        self.p = dist.get_world_size()
        self.unit = FlatUnit(0, self.params, self.p, dist.get_rank())
        self.reduce_scatter, self.all_gather = reduce_scatter, all_gather
        self.slice = nn.Parameter(self.unit.shard.detach().clone())
        self.optimizer = make_optimizer([self.slice])

    def step(self):
        grads = torch.zeros(self.unit.padded_numel)
        for q, start in zip(self.params, self.unit.offsets):
            grads[start : start + q.numel()] = q.grad.reshape(-1)
        self.slice.grad = self.reduce_scatter(grads) / self.p
        self.optimizer.step()
        lo = self.unit.rank * self.unit.shard_numel
        with torch.no_grad():
            self.unit.full[lo : lo + self.unit.shard_numel] = self.slice
        self.all_gather(self.unit.full)  # the parameters are views of it
""",
        },
    ),
    "09_fault_tolerance": (
        dict(
            check_cell="from exercise import checking",
            names={
                "g",
                "ROWS",
                "X_ALL",
                "W_TRUE",
                "Y_ALL",
                "W0",
                "shard_loss",
                "one_process_gradient",
                "survivors_gradient",
                "library_answer",
            },
        ),
        "check_stand_ins(my_stands_in_for, my_loss_scale)",
        {
            "lost shards skipped": "def my_stands_in_for(first_world, survivors, me):\n"
            "    return []\n"
            "def my_loss_scale(first_world, survivors):\n"
            "    return 1.0\n",
            "loss divided by the new world size": "def my_stands_in_for(first_world, survivors, "
            "me):\n"
            "    lost = [r for r in range(first_world) if r not in survivors]\n"
            "    return [r for i, r in enumerate(lost) if survivors[i % len(survivors)] == me]\n"
            "def my_loss_scale(first_world, survivors):\n"
            "    return 1 / len(survivors)\n",
            "no loss scale": "def my_stands_in_for(first_world, survivors, me):\n"
            "    lost = [r for r in range(first_world) if r not in survivors]\n"
            "    return [r for i, r in enumerate(lost) if survivors[i % len(survivors)] == me]\n"
            "def my_loss_scale(first_world, survivors):\n"
            "    return 1.0\n",
            "every lost shard on the first survivor": "def my_stands_in_for(first_world, "
            "survivors, me):\n"
            "    lost = [r for r in range(first_world) if r not in survivors]\n"
            "    return lost if me == survivors[0] else []\n"
            "def my_loss_scale(first_world, survivors):\n"
            "    return len(survivors) / first_world\n",
            "round robin from the last survivor": "def my_stands_in_for(first_world, survivors, "
            "me):\n"
            "    lost = [r for r in range(first_world) if r not in survivors]\n"
            "    order = survivors[::-1]\n"
            "    return [r for i, r in enumerate(lost) if order[i % len(order)] == me]\n"
            "def my_loss_scale(first_world, survivors):\n"
            "    return len(survivors) / first_world\n",
            "borrowed FaultTolerance": "def my_stands_in_for(first_world, survivors, me):\n"
            "    return library_answer(first_world, survivors)[0][me]\n"
            "def my_loss_scale(first_world, survivors):\n"
            "    return library_answer(first_world, survivors)[1]\n",
        },
    ),
}

#: (notebook, answer) -> what the check's message must say (None: the answer passes).
VERDICTS = {
    ("04_model_parallelism", "solution"): None,
    (
        "04_model_parallelism",
        "borrowed balance_by_cost",
    ): "called lightning_par.split.balance_by_cost",
    ("04_model_parallelism", "equal layer counts"): "fullest",
    ("05_pipelining", "solution"): None,
    ("05_pipelining", "borrowed device_schedule"): "called lightning_par.pipeline.schedules",
    ("05_pipelining", "all forwards first"): "activations at once",
    ("06_tensor_and_hybrid", "solution"): None,
    ("06_tensor_and_hybrid", "weights gathered instead of outputs"): "collectives per step",
    ("06_tensor_and_hybrid", "no allreduce of the input gradient"): "Tensor-likes are not close",
    ("07_which_strategy", "solution"): None,
    ("07_which_strategy", "borrowed simulator"): "called lightning_par.simulate",
    ("07_which_strategy", "section 5's table looked up"): "your function raised KeyError",
    ("07_which_strategy", "the ring every step"): "simulator",
    ("08_zero", "solution"): None,
    ("08_zero", "optimizer state not sharded"): "one optimizer over at most S",
    ("08_zero", "optimizer over the whole flat vector"): "one optimizer over at most S",
    ("08_zero", "all-gather forgotten"): "differ from one process's",
    ("08_zero", "the sum taken as the mean (no 1/p)"): "differ from one process's",
    ("08_zero", "borrowed FlatUnit"): "called lightning_par.zero.units",
    ("09_fault_tolerance", "solution"): None,
    ("09_fault_tolerance", "lost shards skipped"): "differs from one process's gradient",
    ("09_fault_tolerance", "loss divided by the new world size"): "differs from one process's",
    ("09_fault_tolerance", "no loss scale"): "differs from one process's gradient",
    ("09_fault_tolerance", "every lost shard on the first survivor"): "round robin gives at most",
    ("09_fault_tolerance", "round robin from the last survivor"): "round robin deals",
    ("09_fault_tolerance", "borrowed FaultTolerance"): "called lightning_par.components",
}
