"""The nets: cifar8-BN and ResNet-34 at batch BatchNorm, each a `Net` value of named stages.

`protocol` defines what a net is (`Net`, `Stage`, `Config`, `Loss`, `Pass`); `layers` the pieces
both nets (and a net of your own) are composed from. Each net module offers `NET` (its `Net`:
`NET.init`, `NET.forward`, `NET.backward` (the rendered chain), `NET.loss_and_grads`,
`NET.forward_eval`, `NET.stages`, `NET.summary`) and `Config`; `protocol.census` counts a params
dict.
"""

import importlib
import importlib.util
import sys
from pathlib import Path

from . import cifar8, layers, protocol, resnet34
from .protocol import Config, Loss, Net, ParamSpec, Pass, Stage

NETS = {"cifar8": cifar8.NET, "resnet34": resnet34.NET}


def load(spec) -> Net:
    """A net by name ("cifar8", "resnet34"), or `path/to/file.py:NAME` or `package.module:NAME`
    naming a `Net` value (a net of your own, built from `gradtie.nets.protocol`)."""
    if isinstance(spec, Net):
        return spec
    if not isinstance(spec, str):
        protocol.require_net(spec, "nets.load")
    if spec in NETS:
        return NETS[spec]
    where, sep, name = str(spec).rpartition(":")
    if not sep or not where or not name:
        raise ValueError(f"net {spec!r}: expected cifar8, resnet34, path/to/file.py:NAME or package.module:NAME")
    if where.endswith(".py"):
        path = Path(where)
        if not path.is_file():
            raise FileNotFoundError(f"net {spec!r}: no such file {where}")
        module_name = f"gradtie_user_net_{path.stem}"
        module_spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[module_name] = module   # dataclasses look their module up there
        try:
            module_spec.loader.exec_module(module)
        except Exception as e:
            del sys.modules[module_name]
            raise ValueError(f"net {spec!r}: importing {where} failed ({type(e).__name__}: {e})") from None
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as e:
            raise ValueError(f"net {spec!r}: cannot import {where} ({e})") from None
    if not hasattr(module, name):
        raise ValueError(f"net {spec!r}: {where} defines no {name}")
    value = getattr(module, name)
    if not isinstance(value, Net):
        raise ValueError(f"net {spec!r}: {name} is a {type(value).__name__}, not a gradtie.nets.protocol.Net")
    return value


__all__ = ["Config", "Loss", "NETS", "Net", "ParamSpec", "Pass", "Stage", "cifar8", "layers", "load", "protocol",
           "resnet34"]
