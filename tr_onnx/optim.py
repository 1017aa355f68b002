"""Optimizers and learning-rate schedules (PyTorch semantics, so curves match torch.optim).

An optimizer is a description: which update op the training pass emits over the flat spans of
parameters/gradients/state, with which attributes, and which state buffers it needs. A
schedule is a pure function of the step, so a checkpoint only needs the step.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field, replace


@dataclass
class Optimizer(ABC):
    lr: float = 1e-3

    op: str = field(default="", init=False, repr=False)  # the ai.tr_onnx update op it emits
    state: tuple[str, ...] = field(default=(), init=False, repr=False)

    @abstractmethod
    def attrs(self) -> dict:
        """Attributes of the update op."""

    def state_init(self, name: str) -> float:
        """Initial value of state buffer ``name``."""
        return 0.0

    def config(self) -> dict:
        return {"name": type(self).__name__, **{k: v for k, v in asdict(self).items()
                                                if k not in ("op", "state")}}


@dataclass
class SGD(Optimizer):
    """torch.optim.SGD (momentum, dampening, nesterov, weight_decay)."""

    lr: float = 0.01
    momentum: float = 0.0
    dampening: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0

    def __post_init__(self):
        self.op, self.state = "SGDUpdate", ("momentum_buffer",)
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise ValueError("SGD: nesterov needs momentum > 0 and dampening 0")

    def attrs(self) -> dict:
        return {"momentum": float(self.momentum), "dampening": float(self.dampening),
                "nesterov": int(self.nesterov), "weight_decay": float(self.weight_decay)}


@dataclass
class Adam(Optimizer):
    """torch.optim.Adam (L2 weight decay added to the gradient)."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    decoupled = False

    def __post_init__(self):
        self.op, self.state = "AdamUpdate", ("exp_avg", "exp_avg_sq")
        self.betas = tuple(self.betas)

    def attrs(self) -> dict:
        return {"beta1": float(self.betas[0]), "beta2": float(self.betas[1]),
                "epsilon": float(self.eps), "weight_decay": float(self.weight_decay),
                "decoupled": int(self.decoupled)}


@dataclass
class AdamW(Adam):
    """torch.optim.AdamW (decoupled weight decay: p *= 1 - lr * weight_decay)."""

    weight_decay: float = 0.01
    decoupled = True


@dataclass
class Adagrad(Optimizer):
    """torch.optim.Adagrad."""

    lr: float = 0.01
    lr_decay: float = 0.0
    weight_decay: float = 0.0
    initial_accumulator_value: float = 0.0
    eps: float = 1e-10

    def __post_init__(self):
        self.op, self.state = "AdagradUpdate", ("sum",)

    def attrs(self) -> dict:
        return {"lr_decay": float(self.lr_decay), "weight_decay": float(self.weight_decay),
                "epsilon": float(self.eps)}

    def state_init(self, name: str) -> float:
        return float(self.initial_accumulator_value)


OPTIMIZERS = {"sgd": SGD, "adam": Adam, "adamw": AdamW, "adagrad": Adagrad}


def make_optimizer(spec: str | Optimizer | dict, lr: float | None = None) -> Optimizer:
    """An Optimizer from an instance, a name (``"adamw"``) or a config dict."""
    if isinstance(spec, Optimizer):
        return spec if lr is None else replace(spec, lr=lr)
    if isinstance(spec, dict):
        spec = dict(spec)
        name = spec.pop("name").lower()
        if "betas" in spec:
            spec["betas"] = tuple(spec["betas"])
    else:
        name, spec = spec.lower(), {}
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; valid: {', '.join(OPTIMIZERS)}")
    if lr is not None:
        spec["lr"] = lr
    return OPTIMIZERS[name](**spec)


# ---- learning-rate schedules ---------------------------------------------------------------

@dataclass
class Schedule:
    """lr(step) for step = 1, 2, ... (the step being taken)."""

    def factor(self, step: int) -> float:
        return 1.0

    def config(self) -> dict:
        return {"name": type(self).__name__, **asdict(self)}


@dataclass
class Constant(Schedule):
    pass


@dataclass
class StepLR(Schedule):
    """lr * gamma ** ((step - 1) // step_size), as torch.optim.lr_scheduler.StepLR stepped per
    optimizer step."""

    step_size: int = 1000
    gamma: float = 0.1

    def factor(self, step: int) -> float:
        return self.gamma ** ((step - 1) // self.step_size)


@dataclass
class Cosine(Schedule):
    """Cosine annealing from lr to ``eta_min_factor * lr`` over ``total_steps``."""

    total_steps: int = 1000
    eta_min_factor: float = 0.0

    def factor(self, step: int) -> float:
        t = min(step - 1, self.total_steps)
        cos = (1 + math.cos(math.pi * t / self.total_steps)) / 2
        return self.eta_min_factor + (1 - self.eta_min_factor) * cos


@dataclass
class Warmup(Schedule):
    """Linear warm-up over ``warmup_steps`` (lr * step / warmup_steps), then ``after``."""

    warmup_steps: int = 100
    after: Schedule = field(default_factory=Constant)

    def factor(self, step: int) -> float:
        if step <= self.warmup_steps:
            return step / self.warmup_steps
        return self.after.factor(step - self.warmup_steps)

    def config(self) -> dict:
        return {"name": "Warmup", "warmup_steps": self.warmup_steps, "after": self.after.config()}


SCHEDULES = {"constant": Constant, "step": StepLR, "cosine": Cosine, "warmup": Warmup}


def make_schedule(spec: str | Schedule | dict | None) -> Schedule:
    if spec is None:
        return Constant()
    if isinstance(spec, Schedule):
        return spec
    if isinstance(spec, dict):
        spec = dict(spec)
        name = spec.pop("name").lower()
        if "after" in spec:
            spec["after"] = make_schedule(spec["after"])
    else:
        name, spec = spec.lower(), {}
    name = {"steplr": "step"}.get(name, name)
    if name not in SCHEDULES:
        raise ValueError(f"unknown lr schedule {name!r}; valid: {', '.join(SCHEDULES)}")
    return SCHEDULES[name](**spec)
