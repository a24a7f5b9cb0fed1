"""The playground of `clew serve`: its stateless episode API on loopback (two servers over one
model standing for two replicas), and the page in a real headless Chromium (Debian's
`chromium`, driven by Playwright) playing mazes with the tiny model.

Set CLEW_PLAYGROUND_SCREENSHOT=PATH to save the comparison test's page as a PNG (the
screenshot in docs/serving.md is made so)."""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.serve_cases import MODEL_ID, get, make_adapter, make_base, open_server, post, serving

from clew.agent import Endpoint, data_url, play_episode
from clew.envs.media import replay
from clew.inference.sampling import SamplingParams
from clew.rollout.loop import RolloutSettings
from clew.serve.playground import outcome

CHROMIUM = shutil.which("chromium")
ENV = "maze_2d/tiny"
OPTIONS = {"cell_px": 14, "action_format": "keyword", "max_turns": 6}
KEYWORDS = ("up", "down", "left", "right", "stop")
GENERATION = {
    "reply_prefix": "<action>",
    "reply_suffix": "</action>",
    "max_generate_length": 1,
    "allowed_tokens": ",".join(KEYWORDS),
    "keep_last_k_images": 3,
}
# The same settings as the rollouts' own, built apart from the playground's code.
SETTINGS = RolloutSettings(
    max_turns=OPTIONS["max_turns"],
    sampling=SamplingParams(temperature=0.0, max_tokens=1, allowed_tokens=KEYWORDS),
    keep_last_k_images=3,
    reply_prefix="<action>",
    reply_suffix="</action>",
)
EPISODE = {"env_id": ENV, "seed": 3, "options": OPTIONS, "generation": GENERATION}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, one_thread) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("playground")
    base = make_base()
    make_adapter(base, root / "adapters" / "alpha", rank=4, seed=1)
    make_adapter(base, root / "adapters" / "beta", rank=8, seed=2)
    return base, root / "adapters"


@pytest.fixture(scope="module")
def url(tiny) -> Iterator[str]:
    base, adapters = tiny
    with serving(open_server(base, adapters=str(adapters))) as served:
        yield served


@pytest.fixture(scope="module")
def second_url(tiny) -> Iterator[str]:
    """Another server over the same model: another replica, sharing nothing with ``url``'s."""
    base, adapters = tiny
    with serving(open_server(base, adapters=str(adapters))) as served:
        yield served


@pytest.fixture(scope="module")
def keyed_url(tiny) -> Iterator[str]:
    base, _ = tiny
    with serving(open_server(base, api_key="secret")) as served:
        yield served


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if CHROMIUM is None:
        pytest.skip("no `chromium` on PATH: install Debian's (apt-get install -y chromium)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=CHROMIUM, headless=True)
        yield chromium
        chromium.close()


def reply_of(url: str, model: str, episode: dict[str, Any]) -> dict[str, Any]:
    """The chat completion's reply to ``episode``'s request, as the page sends it to step."""
    status, r = post(f"{url}/v1/chat/completions", {"model": model, **episode["request"]})
    assert status == 200, r
    return {
        "reply": r["choices"][0]["message"]["content"],
        "finish_reason": r["choices"][0]["finish_reason"],
        "prompt_tokens": r["usage"]["prompt_tokens"],
    }


def step(url: str, episode: dict[str, Any], body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    return post(f"{url}/playground/api/episodes/step", {"state": episode["state"], **body})


def step_through(
    urls: list[str], model: str, episode: dict[str, Any]
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Play ``episode`` to its end as the page does, with urllib, each turn on the next of
    ``urls`` in turn; the last answer and every answer."""
    answers = [episode]
    while episode["request"] is not None:
        url = urls[len(answers) % len(urls)]
        status, episode = step(url, episode, reply_of(url, model, episode))
        assert status == 200, episode
        answers.append(episode)
    return episode, answers


# -- the episode API ------------------------------------------------------------------------


def test_an_episode_through_the_api_plays_as_clew_agent_plays_it(url):
    status, episode = post(f"{url}/playground/api/episodes", EPISODE)
    assert status == 200, episode
    assert episode["turn"] == 0 and episode["max_turns"] == 6 and not episode["done"]
    first = episode["observation"]
    assert first["images"][0].startswith("data:image/png;base64,") and "5x5 maze" in first["text"]
    request = episode["request"]
    assert request["allowed_tokens"] == list(KEYWORDS) and request["continue_final_message"]
    assert request["messages"][-1] == {"role": "assistant", "content": "<action>"}
    assert episode["state"]["history"] == [] and episode["state"]["seed"] == 3
    last, _ = step_through([url], f"{MODEL_ID}:alpha", episode)

    traj = play_episode(Endpoint(url, f"{MODEL_ID}:alpha"), ENV, OPTIONS, 3, SETTINGS)
    assert last["done"] and last["turn"] == traj.turns
    assert last["outcome"] == outcome(traj) and last["end_reason"] == traj.end_reason
    assert last["action"] == traj.actions[-1] and last["reward"] == traj.reward
    final = replay(ENV, 3, traj.actions, OPTIONS).frames[-1]
    assert last["observation"]["images"] == [data_url(final)]  # the frame that ended it
    # The state holds the model's replies; the env read them inside prefix and suffix.
    played = [f"<action>{p['reply']}</action>" for p in last["state"]["history"]]
    assert played == traj.actions


def test_an_episode_stepped_on_two_replicas_in_turn_plays_as_on_one(url, second_url):
    _, episode = post(f"{url}/playground/api/episodes", EPISODE)
    model = f"{MODEL_ID}:alpha"
    _, on_one = step_through([url], model, episode)
    _, on_two = step_through([url, second_url], model, episode)
    assert len(on_two) > 2  # the second replica took steps of an episode the first began
    assert on_two == on_one  # every answer: frames, requests, rewards and states


def test_a_finished_episode_or_a_history_past_its_max_turns_is_refused(url):
    _, episode = post(f"{url}/playground/api/episodes", EPISODE)
    done, _ = step_through([url], MODEL_ID, episode)
    status, body = step(url, done, {"reply": "up"})
    assert status == 409 and body["error"]["code"] == "episode_over"
    assert "POST /playground/api/episodes" in body["error"]["message"]
    state = {**episode["state"], "history": [{"reply": "up"}] * 7}
    status, body = post(f"{url}/playground/api/episodes/step", {"state": state, "reply": "up"})
    assert status == 400 and body["error"]["param"] == "state.history", body
    assert "at most 6 (its max turns)" in body["error"]["message"]


def test_a_tampered_state_is_refused_rather_than_replayed_as_another_episode(url):
    _, episode = post(f"{url}/playground/api/episodes", EPISODE)
    for reply in ("up", "left"):
        status, episode = step(url, episode, {"reply": reply, "finish_reason": "length"})
        assert status == 200, episode
    state = episode["state"]
    assert not episode["done"] and [p["reply"] for p in state["history"]] == ["up", "left"]
    changed = [
        {**state, "history": [{"reply": "down", "finish_reason": "length"}, state["history"][1]]},
        {**state, "history": state["history"][:1]},
        {**state, "history": [{**p, "finish_reason": "stop"} for p in state["history"]]},
        {**state, "seed": 4},
        {**state, "generation": {**state["generation"], "reply_suffix": "</act>"}},
        {**state, "digest": "0" * 32},
    ]
    for tampered in changed:
        status, body = post(
            f"{url}/playground/api/episodes/step", {"state": tampered, "reply": "up"}
        )
        assert status == 409 and body["error"]["code"] == "history_diverged", (tampered, body)
        assert "POST /playground/api/episodes" in body["error"]["message"]
    assert step(url, episode, {"reply": "up"})[0] == 200  # the state as it was still plays


@pytest.mark.parametrize(
    ("change", "param", "says"),
    [
        ({"env_id": "maze_2d/tinny"}, "env_id", "did you mean 'maze_2d/tiny'?"),
        ({"seed": -1}, "seed", "greater than or equal to 0"),
        ({"seed": "three"}, "seed", "valid integer"),
        ({"options": {"cell_pix": 14}}, "options", "accepted options: action_format"),
        ({"options": {"cell_px": 2}}, "options", "cell_px must be an integer >= 4"),
        ({"options": {"cell_px": 10**6}}, "options.cell_px", "magnitude up to 64"),
        ({"generation": {"temperature": -1}}, "generation.temperature", "greater than or equal"),
        ({"generation": {"allowed_tokens": ","}}, "generation", "names no token"),
        (
            {"options": {"grid_size": 63, "cell_px": 64}},
            "options",
            "4032 x 4032 pixels, over the playground's limit",
        ),
        (
            {"options": {"grid_size": 31, "cell_px": 32, "max_turns": 40}},
            "generation.max_turns",
            "lower generation.max_turns (to 17 or fewer)",
        ),
        (
            {"generation": {"keep_last_k_images": 9}},
            "generation.keep_last_k_images",
            "over this server's limit of 8 images per request",
        ),
        ({"generation": {"reply_prefix": "\ud800"}}, "generation.reply_prefix", "unicode string"),
    ],
)
def test_a_bad_env_id_seed_or_option_is_a_400_naming_what_is_accepted(url, change, param, says):
    status, body = post(f"{url}/playground/api/episodes", {**EPISODE, **change})
    assert status == 400, body
    assert body["error"]["param"] == param and says in body["error"]["message"], body


def test_an_episode_longer_than_the_servers_image_limit_plays_to_its_end(tiny):
    """The server takes 2 images a request; an episode of 6 frames keeps within it by
    default (keep_last_k_images: the limit), the older turns sent as their text alone."""
    base, _ = tiny
    from clew.serve.prompt import PromptLimits

    server = open_server(base, limits=PromptLimits(max_images=2))
    options = {**OPTIONS, "max_turns": 6}
    body = {"env_id": ENV, "seed": 3, "options": options, "generation": {"max_generate_length": 1}}
    with serving(server) as small:
        config = json.loads(get(f"{small}/playground/api/config")[1])
        assert config["max_images"] == config["generation"]["keep_last_k_images"] == 2
        status, episode = post(f"{small}/playground/api/episodes", body)
        assert status == 200, episode
        assert episode["state"]["generation"]["keep_last_k_images"] == 2
        last, answers = step_through([small], MODEL_ID, episode)
    assert last["done"] and last["turn"] == 6 and last["why"], last
    for answer in answers[2:-1]:
        images = [
            p
            for m in answer["request"]["messages"]
            if isinstance(m["content"], list)
            for p in m["content"]
            if p["type"] == "image_url"
        ]
        users = [m for m in answer["request"]["messages"] if m["role"] == "user"]
        assert len(images) == 2 and len(users) == answer["turn"] + 1


def test_an_ended_episode_says_why_it_ended(url):
    _, episode = post(f"{url}/playground/api/episodes", EPISODE)
    last, _ = step_through([url], MODEL_ID, episode)
    assert last["why"].startswith(("solved in", "out of turns", "failed after")), last["why"]
    status, body = step(url, episode, {"context_full": True})
    assert status == 200 and "would not fit the context" in body["why"]


def test_a_step_on_the_replica_that_answered_does_not_replay_the_episode(url, monkeypatch):
    import clew.serve.playground as playground

    replays = []
    original = playground.resume
    monkeypatch.setattr(playground, "resume", lambda *a: replays.append(1) or original(*a))
    _, episode = post(f"{url}/playground/api/episodes", EPISODE)
    _, answers = step_through([url], f"{MODEL_ID}:alpha", episode)
    assert len(answers) > 2 and not replays
    # A state this replica did not answer last (an earlier one, sent again) is replayed.
    status, _ = step(url, answers[1], {"reply": "up"})
    assert status == 200 and replays == [1]


def test_a_step_without_a_reply_or_a_whole_state_is_a_400(url):
    _, episode = post(f"{url}/playground/api/episodes", EPISODE)
    status, body = step(url, episode, {})
    assert status == 400 and "reply is required" in body["error"]["message"]
    status, body = post(f"{url}/playground/api/episodes/step", {"reply": "up"})
    assert status == 400 and body["error"]["param"] == "state", body
    state = {**episode["state"], "digest": "not hex"}
    status, body = post(f"{url}/playground/api/episodes/step", {"state": state, "reply": "up"})
    assert status == 400 and body["error"]["param"] == "state.digest", body
    state = {**episode["state"], "options": {"cell_pix": 14}}
    status, body = post(f"{url}/playground/api/episodes/step", {"state": state, "reply": "up"})
    assert status == 400 and body["error"]["param"] == "state.options", body
    status, body = step(url, episode, {"context_full": True})
    assert status == 200 and body["done"] and body["end_reason"] == "context_full"
    assert body["turn"] == 0 and body["observation"] is None
    assert body["state"] == episode["state"]  # no reply was taken


def test_the_config_lists_every_registered_env_and_clew_plays_defaults(url):
    status, raw = get(f"{url}/playground/api/config")
    config = json.loads(raw)
    assert status == 200 and config["model_id"] == MODEL_ID
    tiny = next(e for e in config["envs"] if e["id"] == ENV)
    assert tiny["defaults"] == {"grid_size": 5, "max_turns": 10} and "cell_px" in tiny["options"]
    assert config["generation"]["max_generate_length"] == 64
    assert config["generation"]["temperature"] == 0.0


def test_the_api_is_in_the_openapi_schema_the_fuzz_reads_and_the_page_is_not(url):
    paths = json.loads(get(f"{url}/openapi.json")[1])["paths"]
    assert {
        "/playground/api/config",
        "/playground/api/episodes",
        "/playground/api/episodes/step",
    } <= set(paths)
    assert "/playground" not in paths
    status, html = get(f"{url}/playground")
    assert status == 200 and b"<title>clew playground</title>" in html


def test_with_an_api_key_the_api_needs_it_and_the_page_does_not(keyed_url):
    assert get(f"{keyed_url}/playground")[0] == 200
    assert get(f"{keyed_url}/playground/api/config")[0] == 401
    status, body = post(f"{keyed_url}/playground/api/episodes", EPISODE)
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    auth = {"Authorization": "Bearer secret"}
    status, episode = post(f"{keyed_url}/playground/api/episodes", EPISODE, auth)
    assert status == 200
    stepped = {"state": episode["state"], "reply": "up"}
    assert post(f"{keyed_url}/playground/api/episodes/step", stepped)[0] == 401
    assert post(f"{keyed_url}/playground/api/episodes/step", stepped, auth)[0] == 200


# -- the page in a browser ------------------------------------------------------------------


def columns(page: Any) -> dict[str, dict[str, Any]]:
    """What each column of the page shows, by its model."""
    shown = {}
    for col in page.query_selector_all(".column"):
        shown[col.get_attribute("data-model")] = {
            "replies": [e.text_content() for e in col.query_selector_all(".reply")],
            "frames": [e.get_attribute("src") for e in col.query_selector_all(".turns img")],
            "outcome": col.query_selector(".outcome").text_content(),
            "turns": int(col.query_selector(".turn-count").get_attribute("data-turns")),
            "error": col.query_selector(".error").text_content(),
        }
    return shown


def choose(page: Any, model: str, compare: str, seed: int, generation: dict[str, Any]) -> None:
    page.select_option("#model", model)
    page.select_option("#compare", compare)
    page.select_option("#env", ENV)
    page.fill("#seed", str(seed))
    page.click("#settings summary")
    page.fill("#options", json.dumps(OPTIONS))
    for name, value in generation.items():
        page.fill(f"#{name}", str(value))
    page.click("#play")


@pytest.mark.browser
def test_the_page_plays_two_models_side_by_side_as_clew_agent_plays_them(url, browser):
    page = browser.new_page(viewport={"width": 1000, "height": 700})
    fetched: list[str] = []
    page.on("request", lambda r: fetched.append(r.url))
    page.goto(f"{url}/playground")
    page.wait_for_selector(f"#model option[value='{MODEL_ID}:beta']", state="attached")
    a, b = f"{MODEL_ID}:alpha", f"{MODEL_ID}:beta"
    choose(page, a, b, 3, GENERATION)
    page.wait_for_function(
        "document.querySelectorAll('.column[data-done=true]').length === 2", timeout=120_000
    )
    shown = columns(page)
    assert list(shown) == [a, b]
    for model, col in shown.items():
        traj = play_episode(Endpoint(url, model), ENV, OPTIONS, 3, SETTINGS)
        assert col["error"] == "", col
        assert col["replies"] == traj.actions and col["turns"] == traj.turns == len(traj.actions)
        assert col["outcome"] == outcome(traj)
        frames = replay(ENV, 3, traj.actions, OPTIONS).frames[1:]
        assert col["frames"] == [data_url(f) for f in frames]  # frame by frame, as played
    assert shown[a]["replies"] != shown[b]["replies"]  # two adapters, two ways to play
    assert "5x5 maze" in page.text_content("#task")
    # Nothing came from anywhere but this server (the frames are data URLs).
    assert fetched and all(u.startswith((url, "data:")) for u in fetched), fetched
    if path := os.environ.get("CLEW_PLAYGROUND_SCREENSHOT"):
        save_screenshot(page, Path(path))
    page.close()


@pytest.mark.browser
def test_the_page_asks_for_the_api_key_and_plays_once_it_is_given(keyed_url, browser):
    from playwright.sync_api import expect

    page = browser.new_page()
    page.goto(f"{keyed_url}/playground")
    message = page.locator("#auth-message")
    expect(message).to_contain_text("needs an API key (HTTP 401)")
    assert page.is_disabled("#play")
    page.fill("#api-key", "wrong")
    page.click("#use-key")
    expect(message).to_contain_text("refused this API key (HTTP 401)")
    page.fill("#api-key", "secret")
    page.press("#api-key", "Enter")
    expect(page.locator("#auth")).to_be_hidden()
    expect(page.locator("#play")).to_be_enabled()
    choose(page, MODEL_ID, "", 1, {**GENERATION, "max_turns": 2})
    done = page.locator(".column[data-done=true]")
    expect(done).to_have_count(1, timeout=60_000)
    shown = columns(page)[MODEL_ID]
    assert shown["error"] == "" and shown["turns"] == len(shown["replies"]) >= 1
    assert shown["outcome"] in ("solved", "failed", "out of turns")
    page.close()


@pytest.mark.browser
def test_the_page_shows_why_an_episode_stopped_beside_its_outcome(url, browser):
    from playwright.sync_api import expect

    page = browser.new_page()
    page.goto(f"{url}/playground")
    page.wait_for_selector("#play:enabled")
    choose(page, MODEL_ID, "", 3, {**GENERATION, "max_turns": 2})
    expect(page.locator(".column[data-done=true]")).to_have_count(1, timeout=60_000)
    why = page.locator(".column .why")
    expect(why).to_be_visible()
    expect(why).to_contain_text(re.compile(r"^(solved in|out of turns|failed after)"))
    # A turn the server refuses: the reason is shown under "stopped", with the panel closed.
    page.fill("#max_input_length", "5")
    page.click("#settings summary")
    assert page.locator("#settings").get_attribute("open") is None
    page.click("#play")
    expect(page.locator(".column[data-done=true]")).to_have_count(1, timeout=60_000)
    error = page.locator(".column .error")
    expect(error).to_be_visible()
    expect(error).to_contain_text("max_input_length=5 cannot hold one turn")
    expect(page.locator(".column .outcome")).to_have_text("stopped")
    page.close()


@pytest.mark.browser
def test_the_address_prefills_the_choices(url, browser):
    page = browser.new_page()
    query = "model=visgym-tiny:beta&env=maze_2d/small&seed=5&reply_prefix=%3Caction%3E"
    page.goto(f"{url}/playground?{query}&options=%7B%22cell_px%22%3A%2014%7D")
    page.wait_for_selector("#play:enabled")
    assert page.input_value("#model") == f"{MODEL_ID}:beta"
    assert page.input_value("#compare") == ""  # none by default
    assert page.input_value("#env") == "maze_2d/small" and page.input_value("#seed") == "5"
    assert page.input_value("#reply_prefix") == "<action>"
    assert page.input_value("#options") == '{"cell_px": 14}'
    assert page.input_value("#max_generate_length") == "64"  # clew play's default
    assert "7x7 visual maze" in page.text_content("#env-hint")
    page.close()


def save_screenshot(page: Any, path: Path) -> None:
    """The page as a PNG of 128 colours (a few tens of kB)."""
    from io import BytesIO

    from PIL import Image

    shot = Image.open(BytesIO(page.screenshot(full_page=True))).convert("RGB")
    path.parent.mkdir(parents=True, exist_ok=True)
    shot.quantize(128).save(path, optimize=True)
