"""Coding-agent setup: merge, backup, idempotence, undo byte for byte, refusal of broken configs."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import tomlkit

from app.agents.base import AgentConfigError, Endpoint, Platform
from app.agents.setup import AgentSetup, env_script
from app.agents.targets import AGENTS, get_agent

EP = Endpoint(port=1919, api_key="sk-local", model="qwen3-30b-a3b", context_window=65536)
WRITERS = [a.name for a in AGENTS if a.writes_config]

EXISTING = {   # a user's config with keys (and, for TOML, comments) we must keep
    "claude-code": '{\n  "theme": "dark",\n  "env": {"MY_VAR": "1"},\n  "permissions": {"allow": ["Bash(ls)"]}\n}\n',
    "codex": '# my Codex settings\nmodel = "o3"  # the old default\napproval_policy = "on-request"\n\n'
             '[profiles.fast]\nmodel = "gpt-5-mini" # keep me\n',
    "opencode": '{"theme": "tokyonight", "provider": {"other": {"npm": "x"}}}\n',
    "crush": '{"options": {"debug": true}, "providers": {"mine": {"type": "openai"}}}\n',
}
MALFORMED = {"claude-code": '{"env": {', "codex": 'model = "o3\n[broken', "opencode": "[1, 2",
             "crush": '{"providers": []}'}


@pytest.fixture
def setup(tmp_path):
    plat = Platform(system="linux", env={"HOME": str(tmp_path / "home")})
    return AgentSetup(tmp_path / "data", plat)


def config_file(setup, name) -> Path:
    return get_agent(name).config_path(setup.platform)


@pytest.mark.parametrize("name", WRITERS)
def test_fresh_home_gets_a_new_config_and_undo_removes_it(setup, name):
    change = setup.plan(get_agent(name), EP)
    assert change.before is None and "qwen3-30b-a3b" in change.after and change.diff().startswith("--- /dev/null")
    assert setup.apply(change) is None                      # nothing to back up
    path = config_file(setup, name)
    assert path.exists() and get_agent(name).configured_model(path.read_text()) == "qwen3-30b-a3b"
    setup.undo(name)
    assert not path.exists()


@pytest.mark.parametrize("name", WRITERS)
def test_existing_config_keeps_other_keys_and_undo_is_byte_identical(setup, name):
    path = config_file(setup, name)
    path.parent.mkdir(parents=True)
    path.write_text(EXISTING[name])
    original = path.read_bytes()
    backup = setup.apply(setup.plan(get_agent(name), EP))
    assert backup is not None and backup.read_bytes() == original and "freetoken-backup-" in backup.name
    after = path.read_text()
    for kept in ("dark", "MY_VAR", "Bash(ls)", "on-request", "keep me", "# my Codex settings", "tokyonight",
                 '"other"', '"mine"', '"debug"'):
        if kept in EXISTING[name]:
            assert kept in after, kept
    # a second setup changes nothing and makes no second backup
    again = setup.plan(get_agent(name), EP)
    assert not again.changed and setup.apply(again) is None
    setup.undo(name)
    assert path.read_bytes() == original


@pytest.mark.parametrize("name", WRITERS)
def test_malformed_config_is_refused_without_writing(setup, name):
    path = config_file(setup, name)
    path.parent.mkdir(parents=True)
    path.write_text(MALFORMED[name])
    with pytest.raises(AgentConfigError, match="nothing was changed"):
        setup.plan(get_agent(name), EP)
    assert path.read_text() == MALFORMED[name]
    assert [p.name for p in path.parent.iterdir()] == [path.name]     # no backup, no temp file


def test_claude_code_env_block_is_what_the_client_reads(setup):
    setup.apply(setup.plan(get_agent("claude-code"), EP))
    env = json.loads(config_file(setup, "claude-code").read_text())["env"]
    assert env["ANTHROPIC_BASE_URL"] == "http://127.0.0.1:1919"           # no /v1
    assert env["ANTHROPIC_AUTH_TOKEN"] == "sk-local"
    assert {env[k] for k in ("ANTHROPIC_MODEL", "ANTHROPIC_DEFAULT_OPUS_MODEL", "ANTHROPIC_DEFAULT_SONNET_MODEL",
                             "ANTHROPIC_DEFAULT_HAIKU_MODEL")} == {"qwen3-30b-a3b"}
    assert env["CLAUDE_CODE_ATTRIBUTION_HEADER"] == "0" and env["CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"] == "1"
    assert int(env["API_TIMEOUT_MS"]) >= 600_000


def test_codex_root_keys_come_before_tables(setup):
    path = config_file(setup, "codex")
    path.parent.mkdir(parents=True)
    path.write_text(EXISTING["codex"])
    setup.apply(setup.plan(get_agent("codex"), EP))
    text = path.read_text()
    doc = tomlkit.parse(text)
    assert doc["model"] == "qwen3-30b-a3b" and doc["model_provider"] == "freetoken"
    assert doc["model_context_window"] == 65536
    prov = doc["model_providers"]["freetoken"]
    assert prov["base_url"] == "http://127.0.0.1:1919/v1" and prov["wire_api"] == "responses"
    assert doc["profiles"]["fast"]["model"] == "gpt-5-mini"
    first_table = text.index("[")
    assert text.index("model_provider =") < first_table and text.index("model_context_window") < first_table


def test_model_change_is_detected_and_updated(setup):
    agent = get_agent("opencode")
    setup.apply(setup.plan(agent, EP))
    assert setup.configured_model(agent) == "qwen3-30b-a3b"
    new = Endpoint(port=1919, api_key="sk-local", model="gpt-oss-20b")
    change = setup.plan(agent, new)
    assert change.changed
    setup.apply(change)
    assert setup.configured_model(agent) == "gpt-oss-20b"
    assert json.loads(config_file(setup, "opencode").read_text())["model"] == "freetoken/gpt-oss-20b"
    # undo goes back to before the first setup (no file at all)
    setup.undo("opencode")
    assert not config_file(setup, "opencode").exists()


def test_undo_refuses_to_clobber_later_edits(setup):
    agent = get_agent("claude-code")
    setup.apply(setup.plan(agent, EP))
    path = config_file(setup, "claude-code")
    path.write_text(path.read_text().replace('"dark"', '"light"') + " ")
    with pytest.raises(AgentConfigError, match="edited after"):
        setup.undo("claude-code")
    setup.undo("claude-code", force=True)
    assert not path.exists()
    with pytest.raises(AgentConfigError, match="nothing to undo"):
        setup.undo("claude-code")


def test_paths_per_platform_and_agent_home_variables():
    win = Platform(system="windows", env={"USERPROFILE": r"C:\Users\ana"})
    assert get_agent("claude-code").config_path(win) == Path(r"C:\Users\ana") / ".claude" / "settings.json"
    mac = Platform(system="macos", env={"HOME": "/Users/ana"})
    assert get_agent("opencode").config_path(mac) == Path("/Users/ana/.config/opencode/opencode.json")
    custom = Platform(system="linux", env={"HOME": "/h", "CODEX_HOME": "/c", "CLAUDE_CONFIG_DIR": "/cc",
                                           "XDG_CONFIG_HOME": "/x"})
    assert get_agent("codex").config_path(custom) == Path("/c/config.toml")
    assert get_agent("claude-code").config_path(custom) == Path("/cc/settings.json")
    assert get_agent("crush").config_path(custom) == Path("/x/crush/crush.json")


def test_env_scripts_quote_for_each_shell():
    variables = {"OPENAI_API_KEY": "it's", "OPENAI_BASE_URL": "http://127.0.0.1:1919/v1"}
    assert env_script(variables, "bash").splitlines()[0] == "export OPENAI_API_KEY='it'\\''s'"
    assert env_script(variables, "powershell").splitlines()[0] == "$env:OPENAI_API_KEY = 'it''s'"
    assert env_script(variables, "cmd").splitlines()[1] == 'set "OPENAI_BASE_URL=http://127.0.0.1:1919/v1"'
    with pytest.raises(AgentConfigError):
        env_script(variables, "fish")


def test_cli_setup_dry_run_apply_and_undo(tmp_path):
    env = {"HOME": str(tmp_path / "home"), "FREETOKEN_HOME": str(tmp_path / "ft"), "PATH": "/usr/bin:/bin"}
    cli = [sys.executable, "-m", "ui.entry", "agents"]
    dry = subprocess.run(cli + ["setup", "codex", "--model", "m1", "--port", "1", "--dry-run"], env=env,
                         capture_output=True, text=True)
    assert dry.returncode == 0 and 'wire_api = "responses"' in dry.stdout
    assert not (tmp_path / "home" / ".codex" / "config.toml").exists()
    done = subprocess.run(cli + ["setup", "codex", "--model", "m1", "--port", "1", "--yes"], env=env,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert 'model = "m1"' in (tmp_path / "home" / ".codex" / "config.toml").read_text()
    envout = subprocess.run(cli + ["env", "aider", "--model", "m1", "--port", "1", "--shell", "powershell"],
                            env=env, capture_output=True, text=True)
    assert "$env:OPENAI_API_BASE = 'http://127.0.0.1:1/v1'" in envout.stdout and "openai/m1" in envout.stdout
    undo = subprocess.run(cli + ["undo", "codex"], env=env, capture_output=True, text=True)
    assert undo.returncode == 0 and not (tmp_path / "home" / ".codex" / "config.toml").exists()
    nomodel = subprocess.run(cli + ["setup", "codex", "--port", "1", "--yes"], env=env, capture_output=True, text=True)
    assert nomodel.returncode != 0 and "No model is loaded" in nomodel.stderr
