"""Controls against entropy collapse: an adaptive entropy coefficient and a temperature schedule.

Plain functions on floats, one value per training step; the GRPO loop
(``clew.trainer.grpo``) keeps their state and hands the values to the rollouts and to the
loss as settings.

* The entropy floor (``adapt_entropy_coef``, ``entropy_coef_in_effect``): the weight ``c`` of
  the entropy bonus moves by a fixed step toward keeping the policy's mean token entropy at
  a target: up while the entropy measured is below the target, down while above, clipped
  to ``[min_coef, max_coef]``. It is SAC's automatic temperature tuning (Haarnoja et al.
  2018, https://arxiv.org/abs/1812.05905) with a sign step instead of a gradient step on
  ``log alpha``, as Skywork-OR1's adaptive entropy control does
  (https://arxiv.org/abs/2505.22312), whose bonus is also applied only while the entropy is
  at or below the target: ``alpha = c * 1{entropy <= target}``.
* The temperature schedule (``linear_schedule``): the sampling temperature of each step's
  rollouts, linear from a start value at the first step to an end value at the last.
"""

from __future__ import annotations

import math


def adapt_entropy_coef(
    coef: float,
    entropy: float,
    *,
    target: float,
    step_size: float,
    min_coef: float,
    max_coef: float,
) -> float:
    """The entropy coefficient after a step that measured a mean token ``entropy``.

    ``coef + step_size`` when ``entropy < target``, ``coef - step_size`` when it is above,
    ``coef`` when equal or not finite (nothing was measured); then clipped to
    ``[min_coef, max_coef]``.
    """
    if math.isfinite(entropy):
        if entropy < target:
            coef += step_size
        elif entropy > target:
            coef -= step_size
    return min(max(coef, min_coef), max_coef)


def entropy_coef_in_effect(coef: float, entropy: float | None, target: float) -> float:
    """The weight of the entropy bonus in the loss: ``coef`` while the last measured
    ``entropy`` is at or below ``target`` (or none was measured yet), else 0 (Skywork-OR1's
    ``c * 1{entropy <= target}``: above the target the bonus is off, the floor only lifts)."""
    if entropy is None or not math.isfinite(entropy) or entropy <= target:
        return coef
    return 0.0


def linear_schedule(start: float, end: float, step: int, total_steps: int) -> float:
    """The value at training ``step`` (counted from 1): ``start`` at step 1, ``end`` at step
    ``total_steps``, linear between; ``start`` before step 1 and ``end`` after the last. A
    run of one step takes ``start``."""
    if total_steps <= 1 or step <= 1:
        return start
    if step >= total_steps:
        return end
    return start + (end - start) * (step - 1) / (total_steps - 1)
