"""The playground API's request bodies (``clew.serve.playground``) and the bounds on what an
episode may cost the server.

An episode's cost is its frames: each step renders one and encodes it as a PNG, and a step
that this replica did not answer before replays every frame so far. So the playground
bounds the frame (``MAX_FRAME_PIXELS``, about a 1024 x 1024 frame, cheap to render and
encode on a CPU) and the frames of a whole episode (``MAX_EPISODE_PIXELS``: max turns times
frame pixels, so that a replay's CPU time stays bounded), besides each number in the
options (``MAX_OPTION_NUMBER``). Larger episodes are ``clew play``'s, which runs the env on
the client.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

MAX_OPTION_NUMBER = 64
MAX_FRAME_PIXELS = 1 << 20
MAX_EPISODE_PIXELS = 16 << 20
MAX_SEED = 2**63 - 1
MAX_HISTORY = 10_000  # the schema's bound; an episode's own max turns is the real one

OptionValue = Annotated[str, Field(max_length=200)] | bool | int | float | None
ShortText = Annotated[str, Field(max_length=1000)]
ReplyText = Annotated[str, Field(max_length=1 << 20)]
FinishReason = Annotated[str, Field(max_length=32)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Generation(_Body):
    """How replies are generated: ``clew play``'s flags (None: the flag's default, and for
    ``keep_last_k_images`` the server's image limit)."""

    max_turns: int | None = Field(None, ge=1, le=MAX_HISTORY)
    max_generate_length: int | None = Field(None, ge=1, le=1 << 20)
    max_input_length: int | None = Field(None, ge=1, le=1 << 24)
    reply_prefix: ShortText | None = None
    reply_suffix: ShortText | None = None
    allowed_tokens: ShortText | None = Field(
        None, description="comma-separated token texts, as --allowed-tokens"
    )
    keep_last_k_images: int | None = Field(
        None, ge=1, le=1024, description="at most the server's images per request"
    )
    temperature: float | None = Field(None, ge=0, le=100, allow_inf_nan=False)
    sampling_seed: int | None = Field(None, ge=0, le=MAX_SEED)


class NewEpisode(_Body):
    env_id: str = Field(max_length=200, description="a registered env id (GET .../config)")
    seed: int = Field(ge=0, le=MAX_SEED, description="which episode of the env (the maze)")
    options: dict[Annotated[str, Field(max_length=100)], OptionValue] = Field(
        default_factory=dict, max_length=32, description="env options over the id's defaults"
    )
    generation: Generation = Field(default_factory=Generation)


class Played(_Body):
    """A reply the env has taken: the model's text and how its generation ended."""

    reply: ReplyText
    finish_reason: FinishReason = "stop"


class EpisodeState(NewEpisode):
    """An episode as the page holds it: the answer's ``state``, sent back with each step."""

    history: list[Played] = Field(
        default_factory=list, max_length=MAX_HISTORY, description="the replies played, in order"
    )
    digest: str = Field(
        pattern=r"^[0-9a-f]{32}$", description="the state's digest, as the server returned it"
    )


class Step(_Body):
    """The model's reply to the last request, as the chat completion gave it, and its state."""

    state: EpisodeState
    reply: ReplyText | None = Field(None, description="choices[0].message.content")
    finish_reason: FinishReason = Field("stop", description="choices[0].finish_reason")
    prompt_tokens: int = Field(0, ge=0, le=1 << 40, description="usage.prompt_tokens")
    completion_tokens: int = Field(0, ge=0, le=1 << 40, description="usage.completion_tokens")
    context_full: bool = Field(
        False, description="the server refused the request as over its context"
    )
