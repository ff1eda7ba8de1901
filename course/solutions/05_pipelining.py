import torch

from lightning_par.pipeline.schedule import Step


def two_stage_gpipe(comm, stage, x, y, loss_fn, chunks):
    """One GPipe step of ``chunks`` micro-batches on two ranks: rank 0's ``stage`` holds the
    first layers, rank 1's the rest and computes ``loss_fn``; afterwards the parameters' .grad
    hold the gradient of the batch-mean loss. Activations have shape (n, HIDDEN) for n samples
    (on rank 1, HIDDEN is also ``stage[0].in_features``)."""
    xs, ys = x.tensor_split(chunks), y.tensor_split(chunks)
    if comm.rank == 0:
        outputs = []
        for xi in xs:  # all forwards first
            out = stage(xi)
            comm.send(out.detach(), 1)
            outputs.append(out)
        for out in reversed(outputs):  # rank 1 sends the gradients, last micro-batch first
            out.backward(comm.recv(torch.empty_like(out), 1))
    else:
        received, loss = [], 0.0
        for xi, yi in zip(xs, ys):
            act = comm.recv(torch.empty(len(xi), stage[0].in_features), 0).requires_grad_()
            received.append(act)
            loss = loss + loss_fn(stage(act), yi) * len(xi) / len(x)  # the batch mean
        loss.backward()
        for act in reversed(received):
            comm.send(act.grad, 0)


def two_stage_1f1b(comm, stage, x, y, loss_fn, chunks):
    """Your GPipe step in 1F1B order: the same gradients, at most K - s micro-batches held on
    stage s (see part b)."""
    xs, ys = x.tensor_split(chunks), y.tensor_split(chunks)
    if comm.rank == 0:
        waiting, sends = [], []  # outputs whose gradient has not come back yet; posted sends
        for xi in xs:
            out = stage(xi)
            # not comm.send: rank 1 may be sending a gradient now, and waits for our receive
            sends.append(comm.isend(out.detach(), 1))
            waiting.append(out)
            if len(waiting) == 2:  # the warm-up forward is done: a backward after each forward
                oldest = waiting.pop(0)
                oldest.backward(comm.recv(torch.empty_like(oldest), 1))
        for out in waiting:  # cool-down: the backwards still owed
            out.backward(comm.recv(torch.empty_like(out), 1))
        for handle in sends:
            handle.wait()
    else:
        for xi, yi in zip(xs, ys):  # the last stage: no warm-up, each backward right away
            act = comm.recv(torch.empty(len(xi), stage[0].in_features), 0).requires_grad_()
            (loss_fn(stage(act), yi) * len(xi) / len(x)).backward()  # its share of the mean
            comm.send(act.grad, 0)


def interleaved_order(device, num_devices, v, chunks):
    """Device ``device``'s steps under interleaved 1F1B: Step(stage, "fwd" or "bwd", micro_batch)
    for its stages device, device + K, ..., in Megatron-LM's order (see part c)."""
    k = num_devices
    forwards, backwards = [], []
    for first in range(0, chunks, k):  # groups of K micro-batches ...
        group = range(first, first + k)
        for chunk in range(v):  # ... go round the device's stages
            forwards += [Step(chunk * k + device, "fwd", i) for i in group]
        for chunk in reversed(range(v)):  # backwards visit the stages the other way round
            backwards += [Step(chunk * k + device, "bwd", i) for i in group]
    warmup = min(2 * (k - device - 1) + (v - 1) * k, len(forwards))
    steps = forwards[:warmup]
    for f, b in zip(forwards[warmup:], backwards):
        steps += [f, b]
    return steps + backwards[len(forwards) - warmup :]
