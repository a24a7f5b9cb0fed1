"""The maze's prompt formats: ``clew``, ``visgym`` and ``skyrl-visgym``.

``clew`` is clew's own layout (the image, then a short task prompt; ``Turn N: ...``
feedback; the last action of a reply counts). ``visgym`` is VisGym's own maze conversation,
as its evaluation (``inference/run_inference.py`` with ``--include-env-feedback``, the
``Interactor`` of ``gymnasium/vlm/interactor.py``) and its SFT data
(``visgym_training/src/to_conversation.py``: ``<image>`` then the prompt) present it: the
image, then ``get_prompt()`` and a step counter; later turns ``Environment feedback: ...``
and the counter; VisGym's reading of a reply. ``skyrl-visgym`` is what the SkyRL + VisGym
walkthrough runs (SkyRL's ``examples/train/visgym/env_sft.py``): the text first, then
the image; ``get_prompt()`` with SkyRL's format instruction; later turns VisGym's feedback
sentence alone; SkyRL's reading of a reply. docs/prompt-formats.md names the commits.

Fields the maze fills, by template:

* task prompt: ``grid_size``, ``max_turns``, ``action_help`` (one sentence on the action
  format), ``success`` (one sentence on what counts as solved), ``env_prompt`` (clew's
  own task prompt);
* turns: ``step`` (the number of the turn about to be played, from 1), ``turn`` (turns
  played), ``steps_left`` (turns left after this one: VisGym's "more steps"),
  ``remaining`` (turns left before this one), ``max_turns``, ``turns_left`` (clew's
  sentence: "N turns remain." or "The episode is over.");
* feedback, per outcome (``moved``, ``wall``, ``stop``, ``reached``, ``parse_error``,
  ``invalid``): ``note`` (clew's own sentence), ``direction`` (right/up/left/down, where
  there is one), ``reason`` (why a reply was not executed).
"""

from __future__ import annotations

from clew.envs.prompt_format import PromptFormat, check_templates, register_format, resolve_format

TASK_FIELDS = {"grid_size", "max_turns", "action_help", "success"}
TURN_FIELDS = {"step", "turn", "steps_left", "remaining", "max_turns", "turns_left"}
OUTCOMES: dict[str, set[str]] = {
    "moved": {"note", "direction"},
    "wall": {"note", "direction"},
    "stop": {"note"},
    "reached": {"note", "direction"},
    "parse_error": {"note", "reason"},
    "invalid": {"note", "reason"},
}

# VisGym's RandomMaze2DEnv.get_prompt() for an rgb_array maze with 'move' and 'stop'.
VISGYM_TASK = (
    "You are navigating a {grid_size}x{grid_size} maze. The maze consists of walls (gray) and "
    "paths (white). You are represented by a blue circle, and your goal is to reach the red "
    "target square.\n\nAvailable actions:\n"
    "1. 'move': Move in one of four directions. Format: `('move', direction)` where direction "
    "is an integer:\n   - 0=right, 1=up, 2=left, 3=down\n"
    "2. 'stop': End the navigation session. Format: `('stop', 'stop')`"
    "\n\nSuccess: You succeed if you reach the red target square."
    "\n\nPlease respond with exactly one action and its arguments in the specified format. "
    "For example:\n"
    "- To move right: `('move', 0)`\n- To move up: `('move', 1)`\n"
    "- To move left: `('move', 2)`\n- To move down: `('move', 3)`\n"
    "- To stop: `('stop', 'stop')`"
)
# VisGym's Interactor: the step message after the instructions, and after the feedback.
VISGYM_STEP = "This is step {step}. You are allowed to take {steps_left} more steps."
# VisGym's Maze2DEnv.step: env_feedback for what it executed.
VISGYM_FEEDBACK = {
    "moved": "Action executed successfully.",
    "stop": "Action executed successfully.",
    "reached": "Action executed successfully.",
    "wall": "Cannot move into a wall.",
    "parse_error": "{reason}",
    "invalid": "{reason}",
}
# SkyRL's env_sft.py: _FORMAT_INSTRUCTION, appended to get_prompt().
SKYRL_FORMAT_INSTRUCTION = (
    "\n\nIMPORTANT: Respond with exactly one action as a Python tuple, "
    "e.g. ('move', 0) or ('stop', 'stop'). "
    "Do not wrap the action in backticks, code blocks, or other formatting."
)

CLEW = PromptFormat(
    name="clew",
    task_prompt="{env_prompt}",
    first_turn="{task}",
    later_turn="Turn {turn}: {feedback}. {turns_left}",
    reply_parser="last",
)
VISGYM = PromptFormat(
    name="visgym",
    task_prompt=VISGYM_TASK,
    first_turn="{task}\n" + VISGYM_STEP,
    later_turn="Environment feedback: {feedback}\n\n" + VISGYM_STEP,
    feedback=VISGYM_FEEDBACK,
    image_codec="jpeg",
    reply_parser="visgym",
)
SKYRL_VISGYM = PromptFormat(
    name="skyrl-visgym",
    task_prompt=VISGYM_TASK + SKYRL_FORMAT_INSTRUCTION,
    first_turn="{task}",
    later_turn="{feedback}",
    feedback=VISGYM_FEEDBACK,
    text_first=True,
    reply_parser="skyrl",
)

for _fmt in (CLEW, VISGYM, SKYRL_VISGYM):
    register_format(_fmt)


def maze_format(spec: object, action_format: str) -> PromptFormat:
    """The format ``spec`` names, checked against what the maze can render."""
    from clew.envs.maze.replies import REPLY_PARSERS
    from clew.errors import EnvError

    fmt = resolve_format(spec)  # type: ignore[arg-type]
    check_templates(fmt, TASK_FIELDS, TURN_FIELDS, OUTCOMES)
    if fmt.reply_parser not in REPLY_PARSERS:
        raise EnvError(
            f"prompt_format.reply_parser {fmt.reply_parser!r} is not one of the maze's: "
            f"{', '.join(REPLY_PARSERS)}"
        )
    if fmt.reply_parser != "last" and action_format != "tuple":
        raise EnvError(
            f"prompt_format.reply_parser {fmt.reply_parser!r} reads VisGym's tuple actions; "
            f"the env's action_format is {action_format!r} (use reply_parser 'last', or "
            "action_format 'tuple')"
        )
    return fmt
