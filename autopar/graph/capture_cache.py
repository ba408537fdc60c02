"""Captures kept per model structure: a model traced again with the same structure and input shapes
reuses the first trace instead of running torch.export again.

torch.export costs a second or more per call even for a tiny model, and one process often traces
the same structure many times: ``parallelize`` on each of several meshes, ``compare`` planning the
same model three ways, the 2- and 3-layer traces of ``graph.block_capture`` for every depth of one
width. What export traces is fixed by the model's code, its attributes and the metadata of its
tensors, so the key (``structure_key``) is made of exactly those:

- every module (with its FQN): its class, the functions defined on the class and its bases (a
  monkeypatched method is a new key), ``training``, and its plain attributes by value (numbers,
  strings, dtypes, tuples, dicts, dataclasses and config objects such as Hugging Face's, recursively;
  a small plain tensor by its contents; a function by identity);
- every parameter and buffer: FQN, shape, dtype, device type, ``requires_grad`` and which of them
  are one tensor (tied weights);
- the example inputs' shapes, dtypes and devices, the default dtype and the export flags.

A model holding anything else (a bound method, a large plain tensor, an object of a kind not
listed) or any forward hook gets no key, and is traced every time. Not seen by the key: module-level
globals a forward reads (as with ``jax.jit``, the trace keeps what they were when it was made).
``AUTOPAR_CAPTURE_CACHE=0`` turns the cache off. A hit returns a copy of the kept capture (passes
never share a graph) and re-issues the warnings the trace raised.
"""
from __future__ import annotations

import dataclasses
import enum
import os
import types
import warnings
from collections import OrderedDict

import torch

_SIZE = 32                       # captures kept, least recently used dropped first
_SMALL_TENSOR = 4096             # plain tensor attributes up to this many elements are keyed by value
_DEPTH = 6                       # nesting of attribute values looked into
_MODULE_INTERNALS = frozenset(vars(torch.nn.Module()))   # nn.Module's own bookkeeping attributes
_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")

_KEPT: OrderedDict = OrderedDict()   # key -> (capture, warnings it raised)
_REGISTRY: dict = {}                 # the "once"/"default" warning registry of re-issued warnings


class _Unkeyable(Exception):
    """A value whose effect on the trace the key cannot vouch for."""


def enabled() -> bool:
    """Whether captures are kept (``AUTOPAR_CAPTURE_CACHE`` is not "0")."""
    return os.environ.get("AUTOPAR_CAPTURE_CACHE", "1") != "0"


def clear() -> None:
    """Forget every kept capture."""
    _KEPT.clear()


def structure_key(model: torch.nn.Module, example_inputs: tuple, **flags) -> tuple | None:
    """What torch.export's trace of ``model(*example_inputs)`` depends on (module docstring), or
    None when the model holds something the key cannot describe."""
    if any(getattr(torch.nn.modules.module, g, None) for g in (
            "_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks")):
        return None
    memo: dict[int, object] = {}
    try:
        modules = tuple((name, _module_key(m, memo)) for name, m in model.named_modules(remove_duplicate=False))
        same: dict[int, int] = {}
        tensors = tuple((kind, name, tuple(t.shape), t.dtype, t.device.type, t.requires_grad,
                         same.setdefault(id(t), len(same)))
                        for kind, named in (("param", model.named_parameters(remove_duplicate=False)),
                                            ("buffer", model.named_buffers(remove_duplicate=False)))
                        for name, t in named)
        inputs = tuple(("input", tuple(x.shape), x.dtype, x.device.type, x.requires_grad)
                       if isinstance(x, torch.Tensor) else _value(x, memo, 0) for x in example_inputs)
    except _Unkeyable:
        return None
    return (torch.get_default_dtype(), tuple(sorted(flags.items())), modules, tensors, inputs)


def cached_capture(key: tuple | None, trace, copy):
    """``copy(capture)`` of the capture kept under ``key``, or ``trace()``'s result, kept when
    ``key`` is not None; the warnings the trace raised are issued each time."""
    if key is None or not enabled():
        return trace()
    if key not in _KEPT:
        with warnings.catch_warnings(record=True) as raised:
            warnings.simplefilter("always")
            cap = trace()
        _KEPT[key] = (cap, tuple(raised))
        while len(_KEPT) > _SIZE:
            _KEPT.popitem(last=False)
    _KEPT.move_to_end(key)
    cap, raised = _KEPT[key]
    for w in raised:
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, registry=_REGISTRY)
    return copy(cap)


def _module_key(m: torch.nn.Module, memo: dict) -> tuple:
    if any(getattr(m, h, None) for h in _HOOKS) or getattr(m, "_forward_hooks_with_kwargs", None):
        raise _Unkeyable("hooks")
    attrs = tuple(sorted((k, _value(v, memo, 0)) for k, v in vars(m).items() if k not in _MODULE_INTERNALS))
    return type(m), _class_functions(type(m)), m.training, attrs


def _class_functions(cls: type) -> tuple:
    """The functions (and descriptors) defined on ``cls`` and its bases below nn.Module, by identity."""
    out = []
    for c in cls.__mro__:
        if c in (torch.nn.Module, object):
            break
        out.extend((c, k, v) for k, v in vars(c).items()
                   if isinstance(v, (types.FunctionType, staticmethod, classmethod, property)))
    return tuple(out)


def _value(v, memo: dict, depth: int):
    """A hashable stand-in for an attribute value that decides what a trace does with it."""
    if v is None or isinstance(v, (bool, int, float, complex, str, bytes)):
        return type(v), v
    if isinstance(v, (torch.dtype, torch.device, enum.Enum, torch.Size)):
        return type(v), repr(v)
    if isinstance(v, (types.FunctionType, types.BuiltinFunctionType, type)):
        return "callable", v
    if depth > _DEPTH:
        raise _Unkeyable("nested too deep")
    if id(v) in memo:
        return memo[id(v)]
    memo[id(v)] = ("cycle", id(v))   # a value that contains itself
    memo[id(v)] = key = _compound(v, memo, depth + 1)
    return key


def _compound(v, memo: dict, depth: int):
    if isinstance(v, torch.Tensor):
        if v.numel() > _SMALL_TENSOR or v.is_meta or type(v) is not torch.Tensor:
            raise _Unkeyable("a large or meta plain tensor attribute")
        return "tensor", tuple(v.shape), v.dtype, v.device.type, v.detach().cpu().numpy().tobytes()
    if isinstance(v, torch.nn.Module):
        raise _Unkeyable("a module held outside the module tree")
    if isinstance(v, (tuple, list)):
        return type(v), tuple(_value(x, memo, depth) for x in v)
    if isinstance(v, (set, frozenset)):
        return type(v), tuple(sorted(repr(_value(x, memo, depth)) for x in v))
    if isinstance(v, dict):
        return type(v), tuple(sorted(((repr(_value(k, memo, depth)), _value(x, memo, depth)) for k, x in v.items()),
                                     key=lambda kv: kv[0]))
    if dataclasses.is_dataclass(v):
        return type(v), tuple((f.name, _value(getattr(v, f.name), memo, depth)) for f in dataclasses.fields(v))
    plain = type(v).__repr__ is object.__repr__ or hasattr(v, "to_dict")   # a config object, Hugging Face's too
    if plain and hasattr(v, "__dict__") and not callable(v):
        return type(v), _value(vars(v), memo, depth)
    raise _Unkeyable(type(v).__qualname__)
