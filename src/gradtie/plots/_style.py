"""Figure conventions every chapter's figures share: size, the colour of a tie and of a control."""

OK_COLOR = "tab:blue"
CONTROL_COLOR = "tab:red"
FIGSIZE = (7.0, 4.0)
