"""Experiments over the trainer: config sweeps (``sweep``) and the plots of their runs
(``plots``). Nothing below imports them."""
