"""Optimizers and learning-rate schedules (PyTorch semantics, so curves match torch.optim).

An optimizer is a description: which update op the training pass emits over the flat spans of
parameters/gradients/state, with which attributes, and which state buffers it needs. A
schedule is a pure function of the step, so a checkpoint only needs the step.

Arguments are checked when an optimizer or schedule is made, as ``torch.optim`` checks them
(same messages), and also for NaN and infinity, which PyTorch lets through into NaN weights:
an ``OptionError`` naming the argument and its value.
"""

from __future__ import annotations

import math
import numbers
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field, replace

from .errors import OptionError


def _number(owner: str, name: str, value, what: str, rule: str = "a finite number") -> float:
    """``value`` as a finite float; ``what`` is PyTorch's name for it in ``Invalid {what}``,
    ``rule`` says what ``name`` must be."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise OptionError(f"{owner}: {name}={value!r} is not a number ({name} must be {rule})")
    if not math.isfinite(value):
        raise OptionError(f"{owner}: Invalid {what}: {value} ({name} must be {rule})")
    return float(value)


def _non_negative(owner: str, name: str, value, what: str) -> None:
    rule = "a finite number >= 0"
    if not _number(owner, name, value, what, rule) >= 0.0:
        raise OptionError(f"{owner}: Invalid {what}: {value} ({name} must be {rule})")


def _count(owner: str, name: str, value, least: int) -> None:
    """An integer >= ``least`` (a number of steps)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < least:
        raise OptionError(f"{owner}: Invalid {name}: {value!r} ({name} must be an integer "
                          f">= {least})")


@dataclass
class Optimizer(ABC):
    lr: float = 1e-3

    op: str = field(default="", init=False, repr=False)  # the ai.tr_onnx update op it emits
    state: tuple[str, ...] = field(default=(), init=False, repr=False)

    def __post_init__(self):
        _non_negative(type(self).__name__, "lr", self.lr, "learning rate")

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
        super().__post_init__()
        self.op, self.state = "SGDUpdate", ("momentum_buffer",)
        _non_negative("SGD", "momentum", self.momentum, "momentum value")
        _number("SGD", "dampening", self.dampening, "dampening value")
        _non_negative("SGD", "weight_decay", self.weight_decay, "weight_decay value")
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise OptionError(f"SGD: Nesterov momentum requires a momentum and zero dampening "
                              f"(nesterov=True, momentum={self.momentum}, "
                              f"dampening={self.dampening})")

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
        super().__post_init__()
        self.op, self.state = "AdamUpdate", ("exp_avg", "exp_avg_sq")
        owner = type(self).__name__
        try:
            self.betas = tuple(self.betas)
        except TypeError:
            self.betas = (self.betas,)
        if len(self.betas) != 2:
            raise OptionError(f"{owner}: betas={self.betas!r} must be a pair (beta1, beta2)")
        _non_negative(owner, "eps", self.eps, "epsilon value")
        for i, beta in enumerate(self.betas):
            what, rule = f"beta parameter at index {i}", "a number in [0, 1)"
            if not 0.0 <= _number(owner, f"betas[{i}]", beta, what, rule) < 1.0:
                raise OptionError(f"{owner}: Invalid {what}: {beta} (betas[{i}] must be {rule})")
        _non_negative(owner, "weight_decay", self.weight_decay, "weight_decay value")

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
        super().__post_init__()
        self.op, self.state = "AdagradUpdate", ("sum",)
        _non_negative("Adagrad", "lr_decay", self.lr_decay, "lr_decay value")
        _non_negative("Adagrad", "weight_decay", self.weight_decay, "weight_decay value")
        _non_negative("Adagrad", "initial_accumulator_value", self.initial_accumulator_value,
                      "initial_accumulator_value value")
        _non_negative("Adagrad", "eps", self.eps, "epsilon value")

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

    def __post_init__(self):
        _count("StepLR", "step_size", self.step_size, 1)
        _non_negative("StepLR", "gamma", self.gamma, "gamma")

    def factor(self, step: int) -> float:
        return self.gamma ** ((step - 1) // self.step_size)


@dataclass
class Cosine(Schedule):
    """Cosine annealing from lr to ``eta_min_factor * lr`` over ``total_steps``."""

    total_steps: int = 1000
    eta_min_factor: float = 0.0

    def __post_init__(self):
        _count("Cosine", "total_steps", self.total_steps, 1)
        _non_negative("Cosine", "eta_min_factor", self.eta_min_factor, "eta_min_factor")

    def factor(self, step: int) -> float:
        t = min(step - 1, self.total_steps)
        cos = (1 + math.cos(math.pi * t / self.total_steps)) / 2
        return self.eta_min_factor + (1 - self.eta_min_factor) * cos


@dataclass
class Warmup(Schedule):
    """Linear warm-up over ``warmup_steps`` (lr * step / warmup_steps), then ``after``."""

    warmup_steps: int = 100
    after: Schedule = field(default_factory=Constant)

    def __post_init__(self):
        _count("Warmup", "warmup_steps", self.warmup_steps, 0)
        if not isinstance(self.after, Schedule):
            raise OptionError(f"Warmup: after={self.after!r} is not a schedule (Constant, "
                              "StepLR, Cosine, Warmup)")

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
