"""The two nets: cifar8-BN and ResNet-34 at batch BatchNorm, each a list of named stages.

Each net module offers `Config`, `init`, `forward`, `backward` (the rendered chain),
`loss_and_grads`, `forward_eval`, `stages`, `census` and `summary`; `stages` holds the Stage record
and the folds both nets share.
"""

from . import cifar8, resnet34, stages

__all__ = ["cifar8", "resnet34", "stages"]
