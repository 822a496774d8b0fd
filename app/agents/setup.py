"""Apply an agent's settings safely: show the exact change, back up, write atomically, undo byte for byte.

The journal (data folder, `agents/journal.json`) remembers, per agent, the file we changed, where its
backup is (or that there was no file), and a hash of what we wrote, so undo can refuse to clobber
edits the user made after our setup.
"""
from __future__ import annotations

import difflib
import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from app.agents.base import AgentConfigError, AgentTarget, Endpoint, Platform


@dataclass(frozen=True)
class Change:
    agent: str
    path: Path
    before: str | None          # None: the file does not exist yet
    after: str

    @property
    def changed(self) -> bool:
        return self.before != self.after

    def diff(self) -> str:
        before = [] if self.before is None else self.before.splitlines(keepends=True)
        return "".join(difflib.unified_diff(before, self.after.splitlines(keepends=True),
                                            fromfile=str(self.path) if self.before is not None else "/dev/null",
                                            tofile=str(self.path)))


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        if path.exists():
            os.chmod(tmp, path.stat().st_mode & 0o777)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class AgentSetup:
    def __init__(self, data_dir: Path, platform: Platform | None = None):
        self.platform = platform or Platform()
        self.journal_path = data_dir / "agents" / "journal.json"

    # -- journal --------------------------------------------------------------------------------
    def _journal(self) -> dict:
        if not self.journal_path.exists():
            return {}
        return json.loads(self.journal_path.read_text(encoding="utf-8"))

    def _save_journal(self, journal: dict) -> None:
        _atomic_write(self.journal_path, json.dumps(journal, indent=2).encode())

    # -- the three verbs ------------------------------------------------------------------------
    def plan(self, agent: AgentTarget, endpoint: Endpoint) -> Change:
        """The exact change setup would make; raises AgentConfigError for a config that does not parse."""
        if not agent.writes_config:
            raise AgentConfigError(f"{agent.display} is set up by hand or by environment: "
                                   f"`freetoken agents env {agent.name}` prints what to set")
        path = agent.config_path(self.platform)
        before = path.read_text(encoding="utf-8") if path.exists() else None
        return Change(agent.name, path, before, agent.merge(before, endpoint))

    def apply(self, change: Change) -> Path | None:
        """Write the change with a dated backup beside the file; returns the backup (None if nothing to do)."""
        if not change.changed:
            return None
        journal = self._journal()
        backup = None
        if change.before is not None:
            stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
            backup = change.path.with_name(f"{change.path.name}.freetoken-backup-{stamp}")
            n = 1
            while backup.exists():
                backup = change.path.with_name(f"{change.path.name}.freetoken-backup-{stamp}-{n}")
                n += 1
            backup.write_bytes(change.path.read_bytes())
        data = change.after.encode("utf-8")
        _atomic_write(change.path, data)
        entry = journal.get(change.agent)
        # Undo goes back to the state before the *first* setup: keep the oldest original.
        if entry is None or entry.get("path") != str(change.path):
            entry = {"path": str(change.path), "backup": str(backup) if backup else None,
                     "existed": change.before is not None}
        entry["written_sha256"] = _sha(data)
        journal[change.agent] = entry
        self._save_journal(journal)
        return backup

    def undo(self, agent_name: str, *, force: bool = False) -> str:
        """Restore the file as it was before setup (or remove it if we created it)."""
        journal = self._journal()
        entry = journal.get(agent_name)
        if entry is None:
            raise AgentConfigError(f"FreeToken has not set up {agent_name}; there is nothing to undo")
        path = Path(entry["path"])
        if path.exists() and not force and _sha(path.read_bytes()) != entry["written_sha256"]:
            raise AgentConfigError(f"{path} was edited after FreeToken set it up; undo would lose those edits. "
                                   "Use --force to restore the backup anyway")
        if entry["existed"]:
            backup = Path(entry["backup"])
            if not backup.exists():
                raise AgentConfigError(f"the backup {backup} is gone; cannot restore {path}")
            _atomic_write(path, backup.read_bytes())
            message = f"restored {path} from {backup}"
        else:
            path.unlink(missing_ok=True)
            message = f"removed {path} (it did not exist before setup)"
        del journal[agent_name]
        self._save_journal(journal)
        return message

    def configured_model(self, agent: AgentTarget) -> str | None:
        """The model the agent's config points at now, so the UI can offer an update after a model change."""
        if not agent.writes_config or agent.configured_model is None:
            return None
        path = agent.config_path(self.platform)
        if not path.exists():
            return None
        try:
            return agent.configured_model(path.read_text(encoding="utf-8"))
        except AgentConfigError:
            return None


def env_script(variables: dict[str, str], shell: str) -> str:
    """Lines to paste into a shell; values quoted for that shell."""
    lines = []
    for key, value in variables.items():
        if shell == "bash":
            lines.append(f"export {key}='" + value.replace("'", "'\\''") + "'")
        elif shell == "powershell":
            lines.append(f"$env:{key} = '" + value.replace("'", "''") + "'")
        elif shell == "cmd":
            lines.append(f'set "{key}={value}"')
        else:
            raise AgentConfigError(f"unknown shell {shell!r}; use bash, powershell or cmd")
    return "\n".join(lines)
