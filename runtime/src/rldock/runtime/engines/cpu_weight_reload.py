"""A CPU engine's weight update by a plan of copies, once it has shown it leaves the engine as vLLM's reload does.

Why: vLLM's in-place reload (`model_loader/reload`) is generic. It puts every layer back on the meta device, wraps
each weight loader to count the elements it copies (a TorchDispatchMode around every copy), rebuilds a layer once its
count is complete, runs the layer's post-load processing and copies the result into the old storage. On the CPU,
for the demo's tiny model, an update took about 10 ms that way, of which the oneDNN packing of the linear layers
(the part that must run again) was under a third (a py-spy profile of a device worker, docs/results.md); the
demo's iteration is 0.05-0.1 s, and every iteration updates.

The plan (`ReloadPlan.of`), built once from the model's module tree: each checkpoint tensor either goes into a
parameter as is (norms, biases, the leading rows of a padded embedding) or is a block of rows of a fused layer's
parameter (q, k, v of `qkv_proj`; gate, up of `gate_up_proj`), in the order of the model's
`packed_modules_mapping`, vLLM's own table of what its fused layers hold. An update copies each tensor to its
place, gives each linear layer whose weight vLLM dropped after packing (`remove_weight`) its full weight again,
and runs the layer's own post-load processing (`quant_method.process_weights_after_loading`: the oneDNN, SGL or
zentorch packing vLLM chose at load), as vLLM's reload ends with. Embeddings, whose packed copy serves the
tied LM head, are processed again too.

A plan exists only where every piece is one this module knows: a dense model (every layer it writes unquantized,
linear or embedding; a fused MoE layer or a quantized one gives no plan), at generation TP 1 (the checkpoint's
tensors whole), every checkpoint tensor with a place and every parameter written (or tied to one written). The
engine trusts a plan only after its first update showed it gives the same engine (`VllmRolloutEngine
._choose_the_way`): the plan loads the new weights over the previous ones, then vLLM's reload loads them again,
and every parameter and a short greedy generation's tokens and logprobs must be bitwise what the plan left.
Loading over the previous weights is what lets the generation show state the plan would leave stale (a layer
whose processing it does not run again), which no parameter shows. Any difference keeps vLLM's reload for the
engine's lifetime, logged with what differed; the engine is left as vLLM's reload leaves it either way. What the
check costs, once: the plan's load, a load through vLLM's reload, two generations of 4 tokens and a copy of the
parameters.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any
from weakref import WeakKeyDictionary

import torch
from torch import nn

# The quantization methods whose post-load processing the plan runs again: the CPU's unquantized linear and
# embedding layers (vLLM's dispatch_cpu_unquantized_gemm). A layer with any other method gives no plan.
_LINEAR_METHOD, _EMBEDDING_METHOD = "UnquantizedLinearMethod", "UnquantizedEmbeddingMethod"


@dataclass(frozen=True)
class Place:
    """Where one checkpoint tensor goes: `module`'s parameter `param`, at `offset` rows (a fused layer's block)."""

    module: str
    param: str
    offset: int
    rows: int


@dataclass
class ReloadPlan:
    """Where each checkpoint tensor goes in the engine's model, and which layers process their weights again."""

    model: nn.Module
    places: dict[str, Place]
    # per linear layer whose weight vLLM dropped after packing: the full weight's (rows, columns)
    rebuilt: dict[str, tuple[int, int]]
    processed: list[str]  # layers whose quant_method processes their weights again, in module order

    @classmethod
    def of(cls, model: nn.Module, shapes: Sequence[tuple[str, torch.Size]]) -> ReloadPlan | str:
        """The plan for checkpoint tensors of these names and shapes, or why there is none."""
        modules = dict(model.named_modules())
        packed: dict[str, list[str]] = dict(getattr(model, "packed_modules_mapping", None) or {})
        fused_of = {part: (fused, i) for fused, parts in packed.items() for i, part in enumerate(parts)}
        mapper = getattr(model, "hf_to_vllm_mapper", None)
        blocks: dict[tuple[str, str], dict[int, tuple[str, torch.Size]]] = {}
        whole: dict[str, tuple[str, str, torch.Size]] = {}
        for name, shape in shapes:
            if not shape:
                return f"{name} is a scalar"
            mapped = mapper.map_name(name) if mapper is not None else name
            if mapped is None:
                return f"vLLM's name mapper drops {name}"
            path, _, param = mapped.rpartition(".")
            parent, _, last = path.rpartition(".")
            source = name.rpartition(".")[0].rpartition(".")[2]  # the checkpoint's own layer name (q_proj)
            if last in packed and source in packed[last]:  # the mapper already named the fused layer
                blocks.setdefault((path, param), {})[packed[last].index(source)] = (name, shape)
            elif last in fused_of and path not in modules:
                fused, index = fused_of[last]
                blocks.setdefault((f"{parent}.{fused}" if parent else fused, param), {})[index] = (name, shape)
            else:
                whole[name] = (path, param, shape)
        places: dict[str, Place] = {}
        for name, (path, param, shape) in whole.items():
            problem = _parameter_problem(modules, path, param)
            if problem:
                return f"{name}: {problem}"
            places[name] = Place(path, param, 0, shape[0])
        for (path, param), parts in blocks.items():
            problem = _parameter_problem(modules, path, param)
            if problem:
                return f"{path}.{param}: {problem}"
            last = path.rpartition(".")[2]
            if sorted(parts) != list(range(len(packed[last]))):
                return f"{path}.{param}: the checkpoint holds {len(parts)} of its {len(packed[last])} parts"
            offset = 0
            for index in sorted(parts):
                name, shape = parts[index]
                places[name] = Place(path, param, offset, shape[0])
                offset += shape[0]
        return cls._checked(model, modules, places, shapes)

    @classmethod
    def _checked(
        cls, model: nn.Module, modules: dict[str, nn.Module], places: dict[str, Place], shapes: Sequence
    ) -> ReloadPlan | str:
        """The plan of `places`, or why it cannot be: a parameter no tensor writes, a shape that does not fit."""
        shape_of = dict(shapes)
        targets = {(place.module, place.param) for place in places.values()}
        # a parameter tied to a written one (the LM head to the embedding) shares its storage; an empty one has none
        written_storage = {getattr(modules[m], p).data_ptr() for m, p in targets if getattr(modules[m], p).numel()}
        for path, module in modules.items():
            for param, tensor in module.named_parameters(recurse=False):
                if (path, param) not in targets and tensor.numel() and tensor.data_ptr() not in written_storage:
                    return f"no checkpoint tensor writes {path}.{param}"
        rebuilt: dict[str, tuple[int, int]] = {}
        processed: list[str] = []
        for path, module in modules.items():
            method = _method_of(module)
            touched = any(
                (path, param) in targets or (tensor.numel() and tensor.data_ptr() in written_storage)
                for param, tensor in module.named_parameters(recurse=False)
            )
            if not touched:
                continue
            if method not in (_LINEAR_METHOD, _EMBEDDING_METHOD) and getattr(module, "quant_method", None) is not None:
                return f"{path} is a {type(module).__name__} with {method}, whose weights this plan does not process"
            if method in (_LINEAR_METHOD, _EMBEDDING_METHOD):
                processed.append(path)
            weight = getattr(module, "weight", None)
            if method == _LINEAR_METHOD and weight is not None and weight.numel() == 0:  # dropped after packing
                rows = sum(place.rows for place in places.values() if (place.module, place.param) == (path, "weight"))
                columns = {shape_of[n][1] for n, p in places.items() if (p.module, p.param) == (path, "weight")}
                if rows != getattr(module, "output_size_per_partition", None) or columns != {
                    getattr(module, "input_size_per_partition", None)
                }:
                    return f"{path}: the checkpoint's blocks ({rows} rows of {sorted(columns)}) do not make its weight"
                rebuilt[path] = (rows, columns.pop())
        for name, place in places.items():
            if place.module in rebuilt and place.param == "weight":
                continue
            target = getattr(modules[place.module], place.param)
            shape = torch.Size(shape_of[name])
            sharing = [p for p in places.values() if (p.module, p.param) == (place.module, place.param)]
            # a tensor short of its parameter's rows only as one of its blocks, or as a padded vocabulary's rows
            short_ok = len(sharing) > 1 or _method_of(modules[place.module]) == _EMBEDDING_METHOD
            end = place.offset + place.rows
            if target.shape[1:] != shape[1:] or end > target.shape[0] or (end < target.shape[0] and not short_ok):
                return f"{name} of shape {tuple(shape)} does not fit {place.module}.{place.param} {tuple(target.shape)}"
        return cls(model=model, places=places, rebuilt=rebuilt, processed=processed)

    def load(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy `weights` (every name the plan was built for) to their places and process the layers again."""
        modules = dict(self.model.named_modules())
        fresh = {path: torch.empty(shape, dtype=_dtype_of(modules[path])) for path, shape in self.rebuilt.items()}
        seen: set[str] = set()
        with torch.no_grad():
            for name, tensor in weights:
                place = self.places.get(name)
                if place is None or name in seen:  # the checkpoint's names are the same at every update
                    raise ValueError(f"{name} is {'pushed twice' if place else 'no name the plan was built for'}")
                seen.add(name)
                rows = slice(place.offset, place.offset + place.rows)
                if place.module in fresh and place.param == "weight":
                    fresh[place.module][rows].copy_(tensor)
                else:
                    getattr(modules[place.module], place.param).data[rows].copy_(tensor)
            if len(seen) != len(self.places):
                raise ValueError(f"every tensor must be pushed; missing {sorted(self.places.keys() - seen)[:5]}")
            for path in self.processed:
                module = modules[path]
                if path in fresh:
                    module.weight = nn.Parameter(fresh[path], requires_grad=False)
                module.quant_method.process_weights_after_loading(module)


def _method_of(module: nn.Module) -> str:
    return type(getattr(module, "quant_method", None)).__name__


def _parameter_problem(modules: dict[str, nn.Module], path: str, param: str) -> str | None:
    module = modules.get(path)
    if module is None:
        return f"the model has no layer {path}"
    if not isinstance(getattr(module, param, None), nn.Parameter):
        return f"{path} has no parameter {param}"
    return None


def _dtype_of(module: nn.Module) -> torch.dtype:
    """The dtype a dropped weight had (vLLM keeps it on the empty placeholder)."""
    weight = module.weight
    assert isinstance(weight, torch.Tensor)
    return weight.dtype


def parameters_of(model: nn.Module) -> dict[str, torch.Tensor]:
    """Copies of every parameter (the comparison `update_weights` makes of the plan against vLLM's reload)."""
    return {name: tensor.detach().clone() for name, tensor in model.named_parameters()}


def first_difference(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> str | None:
    """The first parameter that is not bitwise the same in the two, or None."""
    if before.keys() != after.keys():
        return f"parameters {sorted(before.keys() ^ after.keys())} came or went"
    for name, tensor in before.items():
        if tensor.shape != after[name].shape or not torch.equal(tensor, after[name]):
            return name
    return None


def eligible(worker: Any) -> str | None:
    """Why a vLLM worker's engine gets no plan (None: it may): only an unquantized CPU engine at TP 1 without LoRA."""
    from vllm.platforms import current_platform

    config = worker.vllm_config
    if not current_platform.is_cpu():
        return "not a CPU engine"
    if config.parallel_config.tensor_parallel_size != 1:
        return "generation TP > 1"
    if config.lora_config is not None:
        return "LoRA adapters"
    if config.model_config.quantization is not None:
        return f"{config.model_config.quantization} quantization"
    return None


# Each engine model's plan once trusted, and the plan being tried at its first update with the parameters it left.
_PLANS: WeakKeyDictionary[nn.Module, ReloadPlan] = WeakKeyDictionary()
_TRIED: WeakKeyDictionary[nn.Module, tuple[ReloadPlan, dict[str, torch.Tensor]]] = WeakKeyDictionary()


# `load_by_new_plan`'s answer when the weights it loaded were the ones the model held (a LoRA job's first push, of
# adapters still zero): nothing stale could show, so the check waits for an update that changes them. Until one
# does (a learning rate of 0, a schedule warming up from 0), every update pays the plan's load and two copies of
# the parameters beside vLLM's reload.
UNCHANGED = "the weights did not change"


def load_by_new_plan(worker: Any, weights: Sequence[tuple[str, torch.Tensor]]) -> str | None:
    """Runs inside the vLLM worker, whose model holds the previous weights: build the model's plan and load
    `weights` by it, keeping a copy of every parameter it left for `confirm_plan`. Returns why there is no plan
    (None: `weights` went in by it; UNCHANGED: they were the model's already). Loading over other weights is what
    makes the check worth having: a layer the plan would leave stale (its processing not run again) still shows
    the previous weights' effect."""
    reason = eligible(worker)
    if reason is not None:
        return reason
    model = worker.model_runner.get_model()
    plan = ReloadPlan.of(model, [(name, tensor.shape) for name, tensor in weights])
    if isinstance(plan, str):
        return plan
    previous = parameters_of(model)
    try:
        plan.load(weights)
    except Exception as error:  # a layout the plan misread; vLLM's reload follows and puts the model right
        return f"loading by the plan failed: {type(error).__name__}: {error}"
    by_plan = parameters_of(model)
    if first_difference(previous, by_plan) is None:
        return UNCHANGED
    _TRIED[model] = (plan, by_plan)
    return None


def confirm_plan(worker: Any) -> str | None:
    """Runs inside the vLLM worker after vLLM's reload of the weights `load_by_new_plan` loaded: keep the plan if
    it left every parameter as that reload did; else why not."""
    model = worker.model_runner.get_model()
    plan, by_plan = _TRIED.pop(model)
    differs = first_difference(by_plan, parameters_of(model))
    if differs is not None:
        return f"the plan left {differs} other than vLLM's reload does"
    _PLANS[model] = plan
    return None


def load_by_plan(worker: Any, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Runs inside the vLLM worker: load `weights` by the plan `confirm_plan` kept."""
    _PLANS[worker.model_runner.get_model()].load(weights)


def forget_plan(worker: Any) -> None:
    """Runs inside the vLLM worker: drop the plan (the engine's own check refused it)."""
    _PLANS.pop(worker.model_runner.get_model(), None)
