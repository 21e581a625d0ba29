"""The nets: cifar8-BN and ResNet-34 at batch BatchNorm, each a `Net` value of named stages.

`protocol` defines what a net is (`Net`, `Stage`, `Config`, `Loss`, `Pass`); `layers` the pieces
both nets (and a net of your own) are composed from. Each net module offers `NET`, `Config`,
`init`, `forward`, `backward` (the rendered chain), `loss_and_grads`, `forward_eval`, `stages`,
`census` and `summary`.
"""

from . import cifar8, layers, protocol, resnet34
from .protocol import Config, Loss, Net, ParamSpec, Pass, Stage

__all__ = ["Config", "Loss", "Net", "ParamSpec", "Pass", "Stage", "cifar8", "layers", "protocol", "resnet34"]
