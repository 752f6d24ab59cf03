"""grpo_nb_widgets: the display layer. Reads history records (plain dicts) only.

It never imports grpo_nb, so the same views can show any run that produces the same
records (a TRL run through a callback, a saved history.json).
"""

from .plots import plot_reward_curves

__all__ = ["plot_reward_curves"]
