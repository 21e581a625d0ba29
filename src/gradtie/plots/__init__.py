"""Every figure the book draws, a module per chapter (matching `notebooks/`).

Functions take a report and return a matplotlib Figure; chapters show it with `plt.show()` (PNG).
One message per figure, said in its title; labelled axes with units; convergence on log–log with an
O(h²) reference slope; controls in red; fixed size.
"""

from . import bf16_erasure, data_parallel, head_fold, pools, stage_germs, training, whole_net_tie  # noqa: F401
