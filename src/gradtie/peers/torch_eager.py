"""PyTorch eager: the step a PyTorch user writes — the module, `nn.CrossEntropyLoss`, `backward()`.

ResNet-34 is torchvision's `resnet34(num_classes=K)`: gradtie's ResNet-34 parameter names are its
`state_dict` keys without the running statistics. cifar8-BN is `Cifar8BN`, written here from the
architecture in `gradtie.nets.cifar8`'s docstring, its submodules named as gradtie's parameters
(conv1 … conv8, bn1 … bn8, fc1 … fc3), so gradtie's dict loads into it as it is. BatchNorm runs in
training mode (batch statistics, biased variance, ε from the net's config); the loss is
`nn.CrossEntropyLoss(label_smoothing=α)` against the target rows as class probabilities.

torch is an optional dependency (requirements-peers.txt): it is imported when a peer is built, never
when this module is, and `available()` says whether it can be. The step runs on the CPU, or on the
GPU where PyTorch sees one. On a GPU three variants are what users run (`VARIANTS`): "fp32" (TF32
off: true float32), "tf32" (PyTorch's default: TF32 convolutions) and "bf16-cl" (bf16 autocast and
channels_last memory, the usual mixed-precision recipe); cuDNN's autotuner on for all three.
Where torchvision is not installed, `ResNet34` (written here with torchvision's module names) stands
in for it. Shown in: Performance.
"""

from __future__ import annotations

import functools
import importlib
import types
from typing import Any, Mapping, Optional

import numpy as np

from ..nets import cifar8
from .protocol import Peer, check_dtype, config_of, host, net_of

REQUIRES = ("torch",)
VARIANTS = {"fp32": "float32, TF32 off", "tf32": "float32, TF32 on (PyTorch's default for convolutions)",
            "bf16-cl": "bf16 autocast, channels_last"}


def available() -> tuple[bool, str]:
    """(True, "") when torch imports; else (False, why)."""
    for name in REQUIRES:
        try:
            importlib.import_module(name)
        except ImportError as e:
            return False, f"{name} is not installed ({e}); pip install -r requirements-peers.txt"
    return True, ""


def has_torchvision() -> bool:
    try:
        importlib.import_module("torchvision.models")
        return True
    except Exception:   # not installed, or its compiled ops do not load beside this torch
        return False


def version() -> str:
    torch = importlib.import_module("torch")
    return f"torch {torch.__version__}"


def threads(n: Optional[int] = None) -> int:
    """torch.set_num_threads(n) when n is given; the intra-op threads torch runs with."""
    torch = importlib.import_module("torch")
    if n is not None:
        torch.set_num_threads(int(n))
    return torch.get_num_threads()


@functools.cache
def modules() -> types.SimpleNamespace:
    """The nn.Module classes, defined once torch is imported (an optional dependency: a module
    that imported it at the top could not be imported without it)."""
    torch = importlib.import_module("torch")
    nn, F = torch.nn, torch.nn.functional

    class Cifar8BN(nn.Module):
        """cifar8-BN (`gradtie.nets.cifar8`): stages of (conv 3×3 pad 1 → BN → ReLU)² → max pool 2×2,
        widths 16, 16, 32, 32; flatten in (C,H,W) order; fc1 → ReLU → fc2 → ReLU → fc3."""

        def __init__(self, num_classes: int = 10, head_width: int = 512, conv_bias: bool = True, eps: float = 1e-5):
            super().__init__()
            in_ch = 3
            for k, width in enumerate(cifar8.WIDTHS, start=1):
                for j in (2 * k - 1, 2 * k):
                    self.add_module(f"conv{j}", nn.Conv2d(in_ch, width, 3, padding=1, bias=conv_bias))
                    self.add_module(f"bn{j}", nn.BatchNorm2d(width, eps=eps))
                    in_ch = width
            self.fc1 = nn.Linear(cifar8.FLAT, head_width)
            self.fc2 = nn.Linear(head_width, head_width)
            self.fc3 = nn.Linear(head_width, num_classes)

        def flatten(self, x):
            return torch.flatten(x, 1)   # NCHW: (C,H,W) order, as gradtie's

        def forward(self, x):
            for k in range(1, len(cifar8.WIDTHS) + 1):
                for j in (2 * k - 1, 2 * k):
                    x = F.relu(self.get_submodule(f"bn{j}")(self.get_submodule(f"conv{j}")(x)))
                x = F.max_pool2d(x, 2)
            x = F.relu(self.fc1(self.flatten(x)))
            x = F.relu(self.fc2(x))
            return self.fc3(x)

    class Cifar8BNFlattenHWC(Cifar8BN):
        """Planted: flattens in (H,W,C) order, so fc1 reads its inputs permuted."""

        def flatten(self, x):
            return torch.flatten(x.permute(0, 2, 3, 1), 1)

    class BasicBlock(nn.Module):
        def __init__(self, in_ch: int, width: int, stride: int):
            super().__init__()
            self.conv1 = nn.Conv2d(in_ch, width, 3, stride, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(width)
            self.conv2 = nn.Conv2d(width, width, 3, 1, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(width)
            self.downsample = (nn.Sequential(nn.Conv2d(in_ch, width, 1, stride, bias=False), nn.BatchNorm2d(width))
                               if stride != 1 or in_ch != width else None)

        def forward(self, x):
            y = F.relu(self.bn1(self.conv1(x)))
            y = self.bn2(self.conv2(y))
            return F.relu(y + (x if self.downsample is None else self.downsample(x)))

    class ResNet34(nn.Module):
        """torchvision's resnet34 (the same modules and state_dict names), for machines without it."""

        def __init__(self, num_classes: int = 1000):
            super().__init__()
            self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
            self.bn1 = nn.BatchNorm2d(64)
            in_ch = 64
            for layer, (size, width) in enumerate(zip((3, 4, 6, 3), (64, 128, 256, 512)), start=1):
                blocks = []
                for i in range(size):
                    blocks.append(BasicBlock(in_ch, width, 2 if layer > 1 and i == 0 else 1))
                    in_ch = width
                self.add_module(f"layer{layer}", nn.Sequential(*blocks))
            self.fc = nn.Linear(512, num_classes)

        def forward(self, x):
            x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 3, 2, 1)
            for layer in (self.layer1, self.layer2, self.layer3, self.layer4):
                x = layer(x)
            return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))

    return types.SimpleNamespace(torch=torch, Cifar8BN=Cifar8BN, Cifar8BNFlattenHWC=Cifar8BNFlattenHWC,
                                 ResNet34=ResNet34)


def __getattr__(name: str):
    """`torch_eager.Cifar8BN` and its planted twin, built on first use."""
    if name in ("Cifar8BN", "Cifar8BNFlattenHWC"):
        return getattr(modules(), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class Eager:
    """`Prepared` for an nn.Module in training mode at one batch: one step zeroes the gradients, runs
    the forward and the loss, and `backward()` (synchronous on the CPU; on a GPU the step waits for
    the device, as `jax.block_until_ready` does for the JAX sides)."""

    def __init__(self, module, x, targets, alpha: float, order: list[str], autocast: bool = False):
        torch = modules().torch
        self.module, self.x, self.targets, self.order = module.train(), x, targets, order
        self.criterion = torch.nn.CrossEntropyLoss(label_smoothing=float(alpha))
        self.autocast = autocast

    def _run(self):
        torch = modules().torch
        self.module.zero_grad(set_to_none=True)
        if self.autocast:   # the mixed-precision recipe: bf16 inside the module, the loss in float32
            with torch.autocast(self.x.device.type, dtype=torch.bfloat16):
                logits = self.module(self.x)
            out = self.criterion(logits.float(), self.targets)
        else:
            out = self.criterion(self.module(self.x), self.targets)
        out.backward()
        return out

    def step(self) -> None:
        self._run()
        if self.x.is_cuda:
            modules().torch.cuda.synchronize()

    def grads(self) -> tuple[float, dict[str, np.ndarray]]:
        loss = self._run()
        named = dict(self.module.named_parameters())
        return float(loss.item()), {name: named[name].grad.detach().cpu().double().numpy() for name in self.order}


RUNNING = ("running_mean", "running_var", "num_batches_tracked")


def build(net_name: str, cfg, *, cifar8_module: str = "Cifar8BN"):
    """The nn.Module of `net_name` at `cfg` (ResNet-34: torchvision's; no conv biases there)."""
    if net_name == "resnet34":
        if cfg.conv_bias:
            raise ValueError("torch peer: torchvision's resnet34 has no conv biases (conv_bias=True)")
        if has_torchvision():
            return importlib.import_module("torchvision.models").resnet34(num_classes=cfg.num_classes)
        return modules().ResNet34(cfg.num_classes)
    return getattr(modules(), cifar8_module)(cfg.num_classes, cfg.head_width, cfg.conv_bias, cfg.eps)


def load(module, params: Mapping[str, np.ndarray]) -> None:
    """gradtie's parameters into the module by name; every one must land, and only the running
    statistics may stay the module's own."""
    torch = modules().torch
    missing, unexpected = module.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in params.items()},
                                                 strict=False)
    missing = [k for k in missing if not k.endswith(RUNNING)]
    if missing or unexpected:
        raise ValueError(f"torch peer: the module and gradtie's parameters differ: missing {missing[:4]}, "
                         f"unexpected {list(unexpected)[:4]}")


def make(net_name: str, params: Mapping[str, Any], x, targets, *, num_classes: int, dtype: str = "float32",
         alpha: float = 0.0, cifar8_module: str = "Cifar8BN", variant: str = "fp32") -> Eager:
    """The PyTorch eager step of `net_name` at (params, x, targets); float64 is `.double()`;
    variant: one of `VARIANTS` (what the GPU runs; on a CPU only the float32 arithmetic differs
    in speed)."""
    ok, why = available()
    if not ok:
        raise RuntimeError(f"torch peer: {why}")
    torch = modules().torch
    dt = check_dtype(dtype)
    net = net_of(net_name)
    cfg = config_of(net, params, num_classes)
    if net_name == "resnet34" and cfg.eps != 1e-5:
        raise ValueError(f"torch peer: torchvision's resnet34 has BatchNorm ε 1e-5, the config asks {cfg.eps}")
    if variant not in VARIANTS:
        raise ValueError(f"torch peer: variant must be one of {', '.join(VARIANTS)}, got {variant!r}")
    torch.backends.cudnn.allow_tf32 = variant == "tf32"
    torch.backends.cuda.matmul.allow_tf32 = variant == "tf32"
    torch.backends.cudnn.benchmark = True
    module = build(net_name, cfg, cifar8_module=cifar8_module)
    module = module.double() if dt == np.float64 else module.float()
    load(module, host(params, dt))
    where = device()
    # np.array copies: torch tensors over writable, contiguous host memory of their own
    xs = torch.from_numpy(np.array(x, dt)).to(where)
    module = module.to(where)
    if variant == "bf16-cl":
        module, xs = module.to(memory_format=torch.channels_last), xs.to(memory_format=torch.channels_last)
    return Eager(module, xs, torch.from_numpy(np.array(targets, dt)).to(where), alpha, list(params),
                 autocast=variant == "bf16-cl")


def device() -> str:
    """"cuda" where PyTorch sees a GPU (the GPU run, like JAX's default backend there), else "cpu"."""
    ok, _ = available()
    return "cuda" if ok and modules().torch.cuda.is_available() else "cpu"


def peer(*, cifar8_module: str = "Cifar8BN", name: str = "torch") -> Peer:
    return Peer(name, "NCHW", functools.partial(make, cifar8_module=cifar8_module), available, version, threads,
                device)


# Peers that are wrong on purpose: the agreement must go red on them.
PLANTED = {"torch_flatten_hwc": peer(cifar8_module="Cifar8BNFlattenHWC", name="torch, cifar8 flattened (H,W,C)")}
