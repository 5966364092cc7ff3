"""Models of your own: `[model] factory = "package.module:function"`.

The factory has the built-in models' interface (`trainer.models.build_model`): it is called
as ``factory(spec, num_dense, num_tables)`` and returns an `nn.Module` whose
``forward(dense, emb)`` maps ``(B, num_dense)`` and ``(B, num_tables, embedding_dim)``
float32 tensors to ``(B,)`` float32 logits. The model is built on the CPU (the trainer
moves it to its device). A built-in class fits it too (``"trainer.models.dlrm:DLRM"``).

`build_from_factory` imports it and checks the model once, on a probe batch of two samples,
so a mistake fails at start-up naming `model.factory` instead of deep inside DDP or the
loss. The probe leaves no trace: torch's global generator, the module's train/eval mode and
its gradients are as they were, so every trainer and the reference still build identical
models from the same seed.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from common.errors import ConfigError
from common.model_spec import FACTORY_FORM, ModelSpec

FIELD = "model.factory"
PROBE_BATCH = 2  # two samples: a model that drops or merges the batch dimension shows


def build_from_factory(spec: ModelSpec, num_dense: int, num_tables: int) -> nn.Module:
    """Import `spec.factory`, build the model and check it on a probe batch.

    Raises ConfigError naming `model.factory` when the module cannot be imported, the
    attribute is missing or not callable, the call fails, the result is not an `nn.Module`,
    or its forward fails, returns anything but ``(B,)`` float32 logits, or leaves a
    parameter without a gradient (DDP would fail on it only at the next iteration).
    """
    assert spec.factory is not None
    factory = resolve(spec.factory)
    try:
        model = factory(spec, num_dense, num_tables)
    except Exception as exc:
        raise ConfigError(FIELD, f"{spec.factory}(spec, {num_dense}, {num_tables}) raised {exc!r}") from exc
    if not isinstance(model, nn.Module):
        raise ConfigError(FIELD, f"{spec.factory} returned a {type(model).__name__}, not a torch.nn.Module")
    probe(model, spec, num_dense, num_tables)
    return model


def resolve(factory: str) -> Callable[..., Any]:
    """The callable ``"package.module:attribute.path"`` names."""
    form = FACTORY_FORM.fullmatch(factory)
    if form is None:  # the spec refuses it already; a caller may not have gone through it
        raise ConfigError(FIELD, f"must be 'package.module:function', got {factory!r}")
    try:
        target: Any = importlib.import_module(form["module"])
    except Exception as exc:  # a module failing at import time raises anything
        raise ConfigError(
            FIELD, f"cannot import {form['module']!r} (is it on PYTHONPATH?): {exc!r}"
        ) from exc
    for part in form["attribute"].split("."):
        if not hasattr(target, part):
            raise ConfigError(FIELD, f"{form['module']!r} has no attribute {form['attribute']!r}")
        target = getattr(target, part)
    if not callable(target):
        raise ConfigError(FIELD, f"{factory} is a {type(target).__name__}, not callable")
    return target


def probe(model: nn.Module, spec: ModelSpec, num_dense: int, num_tables: int) -> None:
    """Forward and backward on zeros: `model` must return (B,) float32 logits and give every
    trainable parameter a gradient. Leaves RNG, mode and gradients as they were."""
    trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    if not trainable:
        raise ConfigError(FIELD, "the model has no trainable parameter (DDP needs one)")
    dense = torch.zeros(PROBE_BATCH, num_dense)
    emb = torch.zeros(PROBE_BATCH, num_tables, spec.embedding_dim, requires_grad=True)
    was_training = model.training
    model.eval()  # batch norm must not move its running statistics
    try:
        with torch.random.fork_rng(devices=[]):  # e.g. dropout would draw from the seeded generator
            logits = _forward(model, dense, emb)
            logits.sum().backward()
        missing = [name for name, p in trainable if p.grad is None]
    finally:
        model.train(was_training)
        for _, p in trainable:
            p.grad = None
    if missing:
        raise ConfigError(
            FIELD,
            f"parameters {missing} get no gradient from forward(dense, emb): every trainable "
            "parameter must be used (DDP fails on unused ones at the next iteration)",
        )


def _forward(model: nn.Module, dense: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
    """`model(dense, emb)`, checked to be (B,) float32."""
    shapes = f"forward(dense {tuple(dense.shape)}, emb {tuple(emb.shape)})"
    try:
        logits = model(dense, emb)
    except Exception as exc:
        raise ConfigError(FIELD, f"{shapes} raised {exc!r}") from exc
    if not isinstance(logits, torch.Tensor):
        raise ConfigError(FIELD, f"{shapes} returned a {type(logits).__name__}, not a tensor")
    if not logits.requires_grad:
        raise ConfigError(FIELD, f"{shapes} returned logits that depend on no parameter and no embedding")
    if tuple(logits.shape) != (PROBE_BATCH,) or logits.dtype != torch.float32:
        raise ConfigError(
            FIELD,
            f"{shapes} returned {logits.dtype} of shape {tuple(logits.shape)}; it must return "
            f"float32 logits of shape ({PROBE_BATCH},), one per sample",
        )
    return logits
