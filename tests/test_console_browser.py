"""The web console in a real browser: Debian's headless Chromium driven by Playwright,
against a real env server and a real ``openenv-grpc console`` process.

Screenshots land in build/test-artifacts/console/ (CI keeps them as artefacts;
``make console-screenshot`` copies the Atari one to docs/images/ for the README).
Chromium must be installed (scripts/install_system_deps.sh installs Debian's package):
a missing browser fails these tests, it never skips them.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import Browser, Page, expect, sync_playwright

from openenv_grpc.console.app import STATIC_DIR
from openenv_grpc.testing import ConsoleProcess
from openenv_grpc_envs.echo import EchoEnv

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = ROOT / "build" / "test-artifacts" / "console"
CHROMIUM = os.environ.get("OPENENV_CHROMIUM", "/usr/bin/chromium")
# As root in a closed network: no sandbox (Playwright's default), and none of Chromium's
# own background connections (they would only be refused here).
CHROMIUM_ARGS = [
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-quic",
]
TIMEOUT_MS = 20_000


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: run scripts/install_system_deps.sh (Debian chromium)")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@pytest.fixture
def console_tab(browser: Browser, start_server: Any) -> Iterator[Any]:
    """``console_tab(env, *serve_flags)``: a real env server, a console for it and a
    browser tab on the console; returns (server, tab). Everything ends with the test."""
    consoles: list[ConsoleProcess] = []
    tabs: list[ConsolePage] = []

    def open_tab(env: str = "support.envs:CountingEchoEnv", *flags: str) -> tuple[Any, Any]:
        server = start_server(env, *flags)
        consoles.append(ConsoleProcess(server.target))
        tabs.append(ConsolePage(browser, consoles[-1]))
        return server, tabs[-1]

    yield open_tab
    for tab in tabs:
        tab.close()
    for console in consoles:
        console.stop()


class ConsolePage:
    """A browser tab on the console, with the steps a person takes."""

    def __init__(self, browser: Browser, console: ConsoleProcess) -> None:
        self.console = console
        self.closed = False
        self.context = browser.new_context(viewport={"width": 1280, "height": 900})
        self.page: Page = self.context.new_page()
        self.page.set_default_timeout(TIMEOUT_MS)
        expect.set_options(timeout=TIMEOUT_MS)
        self.requests: list[str] = []
        self.errors: list[str] = []
        self.page.on("request", lambda request: self.requests.append(request.url))
        self.page.on("pageerror", lambda error: self.errors.append(str(error)))
        self.page.goto(console.url)
        self.page.wait_for_selector("body[data-ready=true]")

    def open_session(self) -> None:
        self.page.click("#open-session")
        expect(self.page.locator("#session-status")).to_have_text(re.compile("session .* open"))

    def reset(self, seed: int | None = None) -> None:
        before = self.page.locator(".entry[data-op=reset]").count()
        if seed is not None:
            self.page.fill("#reset-seed", str(seed))
        self.page.click("#reset")
        expect(self.page.locator(".entry[data-op=reset]")).to_have_count(before + 1)

    def reset_option(self, label: str, value: str) -> None:
        """Tick "send options" and fill one field of the reset options' form."""
        self.page.check("#reset-with-options")
        self.page.locator("#reset-options").get_by_label(label, exact=True).fill(value)

    def step(self) -> Any:
        """Click Step; returns the new history entry (a result or an error)."""
        history = self.page.locator("#history > li")
        before = history.count()
        self.page.click("#step")
        expect(history).to_have_count(before + 1)
        expect(self.page.locator("#step")).to_be_enabled()
        return history.last

    def action_field(self, label: str) -> Any:
        return self.page.locator("#action").get_by_label(label, exact=True)

    def banner(self) -> Any:
        return self.page.locator("#error-banner")

    def screenshot(self, name: str) -> Path:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        path = ARTIFACTS / name
        self.page.screenshot(path=str(path))
        return path

    def close(self) -> None:
        """Close the tab (and its context); safe to call twice."""
        if not self.closed:
            self.closed = True
            self.context.close()


def test_echo_a_typed_message_comes_back(console_tab: Any) -> None:
    _, tab = console_tab()
    expect(tab.page.locator("#env-name")).to_have_text("echo")
    tab.open_session()
    tab.reset(seed=1)
    tab.action_field("message").fill("hello from the browser")
    entry = tab.step()
    expect(entry.locator(".observation")).to_contain_text("hello from the browser")
    expect(entry.locator(".entry-title")).to_contain_text("reward 2.2")
    tab.screenshot("echo.png")
    # Everything the page loaded came from the console itself (no CDN, no internet).
    assert tab.requests and all(
        url.startswith(tab.console.url) or url.startswith("data:") for url in tab.requests
    ), tab.requests
    assert tab.errors == []
    tab.close()


def test_the_page_ships_no_outside_references() -> None:
    for path in STATIC_DIR.iterdir():
        text = path.read_text()
        assert not re.search(r"https?://|//cdn|@import", text), f"{path.name} refers outside"


def test_an_atari_frame_shows_as_an_image_and_steps_show_live(console_tab: Any) -> None:
    server, tab = console_tab("gymnasium")
    tab.open_session()
    tab.reset_option("env_id", "ALE/Pong-v5")  # the form made for GymnasiumResetOptions
    tab.reset(seed=7)
    first = tab.page.locator(".entry[data-op=reset] img.frame").last
    expect(first).to_be_visible()
    tab.action_field("discrete").fill("2")  # Pong's UP
    fastest = 0.0
    for _ in range(40):
        entry = tab.step()
        expect(entry).not_to_have_class(re.compile("error"))
        shown = tab.page.locator("#live-steps").inner_text()
        if shown not in ("", "\N{EN DASH}"):  # the page's "no figure yet"
            fastest = max(fastest, float(shown))
    frame = tab.page.locator(".entry[data-op=step] img.frame").last
    expect(frame).to_be_visible()
    size = frame.evaluate("img => [img.complete, img.naturalWidth, img.naturalHeight]")
    assert size == [True, 160, 210]
    expect(tab.page.locator(".entry[data-op=step]").last).to_contain_text(
        "210\N{MULTIPLICATION SIGN}160\N{MULTIPLICATION SIGN}3 uint8"
    )
    expect(tab.page.locator("#live-active")).to_have_text("1")
    assert fastest > 0, "the live steps/s never moved while the page was stepping"
    tab.screenshot("atari.png")
    assert tab.errors == []
    tab.close()
    server.wait_until(lambda: server.active() == 0, what="session closed with the page")


def test_a_full_server_shows_the_capacity_error(console_tab: Any) -> None:
    server, tab = console_tab("support.envs:CountingEchoEnv", "--max-concurrent-envs", "1")
    with EchoEnv(server.target):  # someone else holds the only slot
        tab.page.click("#open-session")
        expect(tab.banner()).to_be_visible()
        expect(tab.banner()).to_contain_text("RESOURCE_EXHAUSTED")
        expect(tab.banner()).to_contain_text("capacity 1/1")
        expect(tab.page.locator("#session-status")).to_have_text("no session")
        expect(tab.page.locator("#open-session")).to_be_enabled()
        tab.screenshot("capacity.png")
    server.wait_until(lambda: server.active() == 0, what="slot freed")
    tab.open_session()  # the same page gets in once there is room
    expect(tab.banner()).to_be_hidden()
    tab.close()


def test_errors_show_with_their_code_and_the_session_goes_on(console_tab: Any) -> None:
    server, tab = console_tab("support.envs:FaultyEnv")
    tab.open_session()
    tab.action_field("message").fill("too early")
    entry = tab.step()
    expect(entry).to_have_attribute("data-code", "FAILED_PRECONDITION")
    tab.reset()
    for message, code, words in [
        ("invalid", "INVALID_ARGUMENT", "that move is not allowed here"),
        ("raise", "INTERNAL", "boom in step"),
    ]:
        tab.action_field("message").fill(message)
        entry = tab.step()
        expect(entry).to_have_attribute("data-code", code)
        expect(tab.banner()).to_contain_text(f"{code}: ")
        expect(tab.banner()).to_contain_text(words)
        expect(tab.banner()).to_contain_text("the session is still open")
        tab.reset()  # after an env exception only a reset may follow; it works
    tab.action_field("message").fill("after the errors")
    entry = tab.step()
    expect(entry.locator(".observation")).to_contain_text("after the errors")
    tab.screenshot("errors.png")
    assert server.active() == 1
    tab.close()


def test_closing_the_session_or_the_page_closes_the_stream(console_tab: Any) -> None:
    server, tab = console_tab()
    tab.open_session()
    assert server.active() == 1
    tab.page.click("#close-session")
    expect(tab.page.locator("#session-status")).to_have_text("no session")
    server.wait_until(lambda: server.active() == 0, what="session closed by the button")
    tab.open_session()
    tab.reset()
    tab.close()  # the tab goes away mid-episode
    server.wait_until(lambda: server.active() == 0, what="session closed with the page")
    assert server.closed_envs() == server.created() == 2


def test_forms_cover_enums_maps_oneofs_and_text_boards(console_tab: Any) -> None:
    _, tab = console_tab("openspiel")
    tab.open_session()
    options = tab.page.locator("#reset-options")
    tab.reset_option("game", "tic_tac_toe")
    options.get_by_label("control", exact=True).select_option("CONTROL_MODE_ALL_PLAYERS")
    options.get_by_role("button", name="+ params").click()
    options.get_by_label("key", exact=True).fill("unused_param_is_refused")
    options.locator(".map-entry").get_by_label("value", exact=True).fill("1")
    tab.reset(seed=3)
    # The game refuses the unknown parameter: shown as the server's INVALID_ARGUMENT.
    expect(tab.banner()).to_contain_text("INVALID_ARGUMENT")
    options.get_by_role("button", name="remove").click()
    tab.reset(seed=3)
    expect(tab.banner()).to_be_hidden()
    tab.page.locator("#action").get_by_label("action", exact=True).select_option("id")
    tab.action_field("id").fill("4")
    entry = tab.step()
    board = entry.locator("pre.text").first  # the board, as multi-line text
    expect(board).to_contain_text("x")
    sent = json.loads(tab.page.locator("#action-json").text_content() or "")
    assert sent == {"id": "4"}  # int64 travels as a string: exact beyond 2**53
    tab.screenshot("openspiel.png")
    tab.close()


def test_wordle_boards_show_as_text_and_unknown_words_as_errors(console_tab: Any) -> None:
    _, tab = console_tab("wordle")
    tab.open_session()
    tab.reset(seed=1)
    tab.action_field("guess").fill("zzzzz")
    entry = tab.step()
    expect(entry).to_have_attribute("data-code", "INVALID_ARGUMENT")
    expect(tab.banner()).to_contain_text("'zzzzz' is not in the word list")
    tab.action_field("guess").fill("crane")
    entry = tab.step()
    board = entry.locator("tr", has=tab.page.locator("th", has_text="board")).locator("pre.text")
    expect(board).to_have_text(re.compile(r"^C R A N E\n[GYX ]{9}$"))
    tab.screenshot("wordle.png")
    tab.close()


def test_a_continuous_action_is_typed_as_numbers(console_tab: Any) -> None:
    """A tensor-shaped field (data/shape/dtype) gets a values editor, not base64 bytes."""
    _, tab = console_tab("gymnasium")
    tab.open_session()
    tab.reset_option("env_id", "Pendulum-v1")
    tab.reset(seed=0)
    tab.page.locator("#action").get_by_label("kind", exact=True).select_option("tensor")
    # Only the chosen member of the oneof shows.
    expect(tab.action_field("discrete")).to_be_hidden()
    editor = tab.page.locator("#action [data-tensor=tensor]")
    expect(editor.get_by_label("dtype", exact=True)).to_have_value("float32")
    editor.get_by_label("shape", exact=True).fill("2")
    editor.get_by_label("values", exact=True).fill("0.5")
    entry = tab.step()  # one value for a shape of two: the console refuses, precisely
    expect(entry).to_have_attribute("data-code", "INVALID_ARGUMENT")
    expect(tab.banner()).to_contain_text("shape [2] holds 2 values, got 1")
    editor.get_by_label("shape", exact=True).fill("1")
    entry = tab.step()
    expect(entry).not_to_have_class(re.compile("error"))
    expect(entry.locator(".entry-title")).to_contain_text("step 1 · reward -")
    expect(entry.locator(".tensor").first).to_contain_text("3 float32")  # cos, sin, speed
    tab.screenshot("pendulum.png")
    tab.close()


def test_a_bridged_openenv_env_is_played_from_its_built_types(console_tab: Any) -> None:
    """An OpenEnv env served with --openenv: the forms come from the types the server
    built from its pydantic models, like any env's."""
    _, tab = console_tab("--openenv=support.openenv_envs.echo:EchoEnvironment")
    expect(tab.page.locator("#env-name")).to_have_text("EchoEnvironment")
    tab.open_session()
    tab.reset(seed=1)
    expect(tab.page.locator(".entry[data-op=reset] .observation").last).to_contain_text(
        "Echo environment ready!"
    )
    tab.action_field("message").fill("hello")
    entry = tab.step()
    expect(entry.locator(".observation")).to_contain_text("hello")
    expect(entry.locator(".entry-title")).to_contain_text("reward 0.5")
    expect(entry).to_contain_text("original_message")  # the observation's metadata: info
    tab.screenshot("openenv-echo.png")
    assert tab.errors == []
    tab.close()


def test_a_bridged_env_takes_typed_reset_options_and_shows_pydantic_refusals(
    console_tab: Any,
) -> None:
    _, tab = console_tab("--openenv=support.openenv_envs.warehouse:WarehouseEnvironment")
    tab.open_session()
    tab.reset_option("difficulty", "3")
    tab.reset(seed=3)
    expect(tab.page.locator(".entry[data-op=reset]").last).to_contain_text("drill")
    tab.action_field("mode").fill("steal")
    entry = tab.step()
    expect(entry).to_have_attribute("data-code", "INVALID_ARGUMENT")
    expect(tab.banner()).to_contain_text("mode: Input should be 'add' or 'remove'")
    expect(tab.banner()).to_contain_text("the session is still open")
    tab.action_field("mode").fill("add")
    entry = tab.step()
    expect(entry.locator(".entry-title")).to_contain_text("reward -0.1")
    tab.screenshot("openenv-warehouse.png")
    tab.close()
