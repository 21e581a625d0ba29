"""Every figure a chapter draws: functions take a report and return a matplotlib Figure.

One message per figure, said in its title; labelled axes with units; convergence on log–log with an
O(h²) reference slope; controls in red; fixed size. Chapters show them with `plt.show()` (PNG).
"""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np

OK_COLOR = "tab:blue"
CONTROL_COLOR = "tab:red"
FIGSIZE = (7.0, 4.0)


# ---- Pools ---------------------------------------------------------------------------------------

# ---- Head fold -----------------------------------------------------------------------------------

# ---- Stage germs ---------------------------------------------------------------------------------

# ---- Whole-net tie -------------------------------------------------------------------------------

# ---- bf16 erasure --------------------------------------------------------------------------------
