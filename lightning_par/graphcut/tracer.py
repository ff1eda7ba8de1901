"""Tracing a user's network into a ``torch.fx`` graph, with the shapes of one example input.

Why ``torch.fx`` and not ``torch.export``: a pipeline stage must hold the user's own module
objects, so that parameter names, ``requires_grad_`` freezing, hooks and BatchNorm's
in-place statistics behave as without the strategy. fx keeps every ``torch.nn`` layer as a
``call_module`` node on the very module object; ``torch.export`` lowers to ATen operators,
lifts parameters into inputs and functionalises buffer updates, and (torch 2.14) cannot
export Lightning's demo ``Transformer`` at all (``nn.Transformer`` checks its mask's
values). torch's own ``pipeline()`` (``torch/distributed/pipelining/_IR.py``) takes the export
route and rebuilds the hierarchy afterwards.

Plain ``fx.symbolic_trace`` fails on ordinary user code that reads shapes
(``b, c, h, w = x.shape``, ``torch.ones(t, t)``). :class:`ShapeTracer` runs the graph on
``meta`` tensors while it builds it (as HuggingFace's ``HFTracer`` does), so every proxy
knows its example value and answers ``shape``, ``size()``, ``dim()``, ``dtype`` and
``len()`` concretely. The graph is therefore specialised to the example's shapes (callers
trace once per input shape); what it cannot specialise, a Python ``if`` on a tensor's
*values*, stops the trace with :class:`UnsplittableModel`, naming the module and the line.
"""

from __future__ import annotations

import inspect
import operator
import traceback
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import fx, nn
from torch.func import functional_call

META = torch.device("meta")


class UnsplittableModel(RuntimeError):
    """The network cannot be cut into stages (raised before any process starts)."""


def to_meta(value: Any) -> Any:
    """``value`` with every tensor and device moved to ``meta`` (shapes kept, no data)."""

    def convert(a: Any) -> Any:
        if isinstance(a, torch.Tensor) and a.device != META:
            return a.detach().to(META).requires_grad_(a.requires_grad)
        if isinstance(a, torch.device):
            return META
        return a

    return fx.node.map_aggregate(value, convert)


def _user_frame() -> str:
    """The innermost source line outside torch and this module: where the user's code is."""
    for frame in reversed(traceback.extract_stack()):
        path = frame.filename.replace("\\", "/")
        if "/torch/" not in path and not path.endswith("graphcut/tracer.py"):
            return f"{frame.filename}:{frame.lineno}: {(frame.line or '').strip()}"
    return "<unknown>"


class ShapedProxy(fx.Proxy):
    """An fx proxy that knows its example value, so shape questions get concrete answers."""

    @property
    def example(self) -> Any:
        return self.node.meta.get("example")

    def _concrete(self) -> torch.Tensor | None:
        value = self.example
        return value if isinstance(value, torch.Tensor) else None

    def __getattr__(self, name: str) -> Any:
        value = self._concrete()
        if value is not None:
            if name in ("shape", "dtype", "ndim", "is_floating_point"):
                return getattr(value, name)
            if name in ("size", "dim", "numel", "nelement"):
                return getattr(value, name)
        return super().__getattr__(name)

    def __len__(self) -> int:
        value = self.example
        if isinstance(value, torch.Tensor | tuple | list):
            return len(value)
        raise UnsplittableModel(f"len() of a traced value of unknown length at {_user_frame()}")

    def __iter__(self) -> Iterator[Any]:
        return (self[i] for i in range(len(self)))

    def __setitem__(self, key: Any, value: Any) -> None:  # x[:, ::2] = ... records the write
        self.tracer.create_proxy("call_function", operator.setitem, (self, key, value), {})

    def __bool__(self) -> bool:
        module = next(reversed(self.tracer.module_stack), "") or "the top-level module"
        raise UnsplittableModel(
            f"data-dependent Python control flow in {module!r}: a Python `if`/`while`/`and` on "
            f"a tensor's values ({_user_frame()}); a traced graph cannot follow it. Move that "
            "code into a module of its own and keep the split points outside it, or compute "
            "the branch with torch.where"
        )


class ShapeTracer(fx.Tracer):
    """fx tracing with example values propagated on ``meta`` tensors (see the module doc).

    Args:
        leaf_modules: qualified names of modules to keep whole (as ``call_module`` nodes)
            besides fx's default leaves, every ``torch.nn`` layer.
    """

    def __init__(
        self, leaf_modules: Sequence[str] = (), sizes: Mapping[int, torch.Size] | None = None
    ) -> None:
        super().__init__()
        self.leaf_names = set(leaf_modules)
        #: id(tensor) -> its real shape, for tensors whose storage was released (a pipeline
        #: device empties the layers other devices hold, and may trace again later)
        self.sizes = dict(sizes or {})
        self._examples: list[Any] = []
        self._evaluating = False

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        # a BatchNorm subclass of ours (DeferredBatchNorm) is a layer, as torch's own are
        return (
            module_qualified_name in self.leaf_names
            or isinstance(m, nn.modules.batchnorm._BatchNorm)
            or super().is_leaf_module(m, module_qualified_name)
        )

    def call_module(self, m: nn.Module, forward: Any, args: Any, kwargs: Any) -> Any:
        if self._evaluating:  # computing an example value: run the layer, record nothing
            return forward(*args, **kwargs)
        return super().call_module(m, forward, args, kwargs)

    def proxy(self, node: fx.Node) -> fx.Proxy:
        return ShapedProxy(node, self)

    def create_proxy(self, kind, target, args, kwargs, name=None, type_expr=None, *rest, **kw):
        proxy = super().create_proxy(kind, target, args, kwargs, name, type_expr, *rest, **kw)
        if kind == "placeholder":
            proxy.node.meta["example"] = self._examples.pop(0) if self._examples else None
        else:
            proxy.node.meta["example"] = self._evaluate(proxy.node)
        return proxy

    def getattr(self, attr: str, attr_val: Any, parameter_proxy_cache: dict) -> Any:
        if self._evaluating:
            return attr_val
        return super().getattr(attr, attr_val, parameter_proxy_cache)

    def _evaluate(self, node: fx.Node) -> Any:
        """The node's value on ``meta`` tensors, from its inputs' example values."""
        self._evaluating = True  # fx patches module calls and attributes while it traces
        try:
            args, kwargs = fx.node.map_arg((node.args, node.kwargs), self._example_of)
            return self._run(node, to_meta(args), to_meta(kwargs))
        finally:
            self._evaluating = False

    def _run(self, node: fx.Node, args: Any, kwargs: Any) -> Any:
        if node.op == "get_attr":
            return self._meta(_get_attr(self.root, node.target))
        if node.op == "call_function":
            return node.target(*args, **kwargs)
        if node.op == "call_method":
            return getattr(args[0], node.target)(*args[1:], **kwargs)
        if node.op == "call_module":
            module = self.root.get_submodule(node.target)
            state = {k: self._meta(v) for k, v in module.state_dict(keep_vars=True).items()}
            try:
                return functional_call(module, state, tuple(args), kwargs)
            except (RuntimeError, NotImplementedError):
                # a layer that reads values (nn.Transformer checks its mask): run it for real
                # on zeros of the example shapes, only to learn its output shapes
                return to_meta(_run_on_zeros(module, args, kwargs))
        return None

    def _meta(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor) and id(value) in self.sizes:
            return torch.empty(self.sizes[id(value)], dtype=value.dtype, device="meta")
        return to_meta(value)

    def _example_of(self, node: fx.Node) -> Any:
        # fx creates the get_attr nodes of parameters and constants without create_proxy
        if "example" not in node.meta and node.op == "get_attr":
            node.meta["example"] = self._evaluate(node)
        return node.meta.get("example")

    def trace_with(self, root: nn.Module, example_inputs: Sequence[Any]) -> fx.Graph:
        """Trace ``root.forward`` for inputs shaped like ``example_inputs`` (positional)."""
        self._examples = [to_meta(x) for x in example_inputs]
        saved = [(m, dict(m.__dict__), dict(m._buffers)) for m in root.modules()]
        try:
            graph = self.trace(root, concrete_args=_defaults_after(root, len(example_inputs)))
        except UnsplittableModel:
            raise
        except Exception as error:  # fx's own errors, with where in the user's code
            raise UnsplittableModel(
                f"cannot trace {type(root).__name__}.forward into a graph: "
                f"{type(error).__name__}: {error}"
            ) from error
        finally:
            # forward may cache tensors on the module (self.mask = ...): proxies must not stay
            for module, attributes, buffers in saved:
                _restore(module.__dict__, attributes)
                _restore(module._buffers, buffers)
        placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        for constant in placeholders[len(example_inputs) :]:  # defaults traced as constants
            checks = list(constant.users)
            if all(c.op == "call_function" and not c.users for c in checks):
                for check in checks:  # fx's "was specialised to None" assertions
                    graph.erase_node(check)
                graph.erase_node(constant)
                placeholders.remove(constant)
        if len(placeholders) != len(example_inputs):
            raise UnsplittableModel(
                f"{type(root).__name__}.forward takes {len(placeholders)} inputs "
                f"({', '.join(n.name for n in placeholders)}) but {len(example_inputs)} "
                "example inputs were given"
            )
        return graph


def _restore(now: dict[str, Any], before: dict[str, Any]) -> None:
    """Undo what tracing ``forward`` wrote into a module's attributes, keeping the tensor
    constants fx itself stored on the root (``_tensor_constant0``, ...)."""
    for key in [k for k in now if k not in before and not k.startswith("_tensor_constant")]:
        del now[key]
    now.update(before)


def _run_on_zeros(module: nn.Module, args: Any, kwargs: Any) -> Any:
    device = next((t.device for t in module.state_dict().values()), torch.device("cpu"))

    def zeros(a: Any) -> Any:
        if isinstance(a, torch.Tensor):
            return torch.zeros(a.shape, dtype=a.dtype, device=device)
        return device if isinstance(a, torch.device) else a

    with torch.no_grad():
        return module(*fx.node.map_aggregate(args, zeros), **fx.node.map_aggregate(kwargs, zeros))


def _defaults_after(root: nn.Module, given: int) -> dict[str, Any] | None:
    """The defaults of ``forward``'s parameters after the ``given`` positional ones: they are
    traced as constants (e.g. Lightning's demo Transformer's ``mask=None``)."""
    parameters = list(inspect.signature(root.forward).parameters.values())[given:]
    defaults = {
        p.name: p.default
        for p in parameters
        if p.default is not inspect.Parameter.empty
        and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    }
    return defaults or None


def _get_attr(root: nn.Module, target: str) -> Any:
    value: Any = root
    for part in target.split("."):
        value = getattr(value, part)
    return value


def trace(
    model: nn.Module,
    example_inputs: Sequence[Any],
    leaf_modules: Sequence[str] = (),
    sizes: Mapping[int, torch.Size] | None = None,
) -> fx.GraphModule:
    """``model`` as an ``fx.GraphModule`` over the same module objects, each node carrying its
    example value (``node.meta["example"]``, a ``meta`` tensor) for ``example_inputs``
    (``sizes``: real shapes of released tensors, see :class:`ShapeTracer`)."""
    tracer = ShapeTracer(leaf_modules, sizes)
    graph = tracer.trace_with(model, example_inputs)
    return fx.GraphModule(tracer.root, graph, type(model).__name__)
