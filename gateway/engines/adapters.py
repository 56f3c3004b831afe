"""LoRA adapters in the local engine: what requests may name, and what the model holds.

Two sides, because loading happens on the engine's worker thread while requests arrive on the event loop:

- ``AdapterNames`` (event loop): the names requests may use. A name appears once its load has finished and
  disappears as soon as an unload starts, so no new request picks an adapter that is going away. As with vLLM,
  loading a name again from the same folder is a no-op; another folder under a name in use is refused.
- ``ModelAdapters`` (worker thread): the PEFT adapters injected into the model and which one is active. Commands
  run between forward passes, so they never race one; an unload waits until no accepted request uses the adapter.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import warnings
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from gateway.errors import APIError, BadRequest, NotFound

logger = logging.getLogger("gateway.engines.local")

CommandKind = Literal["load", "unload"]


@dataclass(eq=False)
class AdapterCommand:
    """A load or unload for the worker; ``done`` is settled on the caller's loop when it has run."""

    kind: CommandKind
    name: str
    path: str
    loop: asyncio.AbstractEventLoop
    done: asyncio.Future[None]


def resolve(command: AdapterCommand, error: APIError | None) -> None:
    """Settle ``command`` from the worker thread: done, or failed with ``error``."""

    def settle() -> None:
        if command.done.done():
            return
        if error is None:
            command.done.set_result(None)
        else:
            command.done.set_exception(error)

    with contextlib.suppress(RuntimeError):  # the caller's loop is gone
        command.loop.call_soon_threadsafe(settle)


class AdapterNames:
    """The adapter names visible to requests, and the loads and unloads under way (event-loop side)."""

    def __init__(self) -> None:
        self._names: set[str] = set()
        self._busy: set[str] = set()  # being loaded or unloaded
        self._paths: dict[str, str] = {}  # name -> the folder it was loaded from
        self._loads: dict[str, asyncio.Future[None]] = {}  # loads in progress, by name

    def __contains__(self, name: object) -> bool:
        return name in self._names

    def sorted(self) -> list[str]:
        return sorted(self._names)

    def clear(self) -> None:
        self._names.clear()
        self._paths.clear()

    async def load(self, name: str, path: str, run: Callable[[CommandKind, str, str], Awaitable[None]]) -> None:
        """Load the PEFT adapter in ``path`` as ``name`` through ``run`` (which hands the command to the worker)."""
        if not name:
            raise BadRequest("the adapter name is empty", param="name")
        folder = str(Path(path).resolve())
        if name in self._paths and self._paths[name] == folder:
            pending = self._loads.get(name)
            if pending is not None:
                await asyncio.shield(pending)
            if name in self._names:
                return
        if name in self._names or name in self._busy:
            raise BadRequest(f"adapter {name!r} is already loaded (from another folder)", param="name")
        if not (Path(path) / "adapter_config.json").is_file():
            raise BadRequest(f"no PEFT adapter (adapter_config.json) in {path!r}", param="path")
        self._busy.add(name)
        self._paths[name] = folder
        done = self._loads[name] = asyncio.get_running_loop().create_future()
        try:
            await run("load", name, path)
            self._names.add(name)
        except BaseException:
            del self._paths[name]
            raise
        finally:
            self._busy.discard(name)
            del self._loads[name]
            done.set_result(None)

    async def unload(self, name: str, run: Callable[[CommandKind, str, str], Awaitable[None]]) -> None:
        if name not in self._names:
            raise NotFound(f"adapter {name!r} is not loaded", param="name")
        # Hidden at once so no new request picks it; requests already accepted for it still finish.
        self._names.discard(name)
        self._paths.pop(name, None)
        self._busy.add(name)
        try:
            await run("unload", name, "")
        finally:
            self._busy.discard(name)


class ModelAdapters:
    """The adapters injected into the model and the one active (worker thread only)."""

    def __init__(self) -> None:
        self._internal: dict[str, str] = {}
        self._ids = itertools.count()
        self._applied: str | None = None
        self._applied_valid = False

    def __contains__(self, name: object) -> bool:
        return name in self._internal

    def clear(self) -> None:
        """Forget everything: the next model is loaded without adapters."""
        self._internal.clear()
        self._applied_valid = False

    def run(self, model: Any, commands: list[AdapterCommand], in_use: Callable[[str], bool]) -> list[AdapterCommand]:
        """Run what can run of ``commands`` and return the rest, in order.

        An unload waits while ``in_use(name)``; later commands for the same name wait behind it so they keep their
        order.
        """
        deferred: list[AdapterCommand] = []
        blocked: set[str] = set()
        for command in commands:
            if command.name in blocked or (command.kind == "unload" and in_use(command.name)):
                deferred.append(command)
                blocked.add(command.name)
                continue
            try:
                if command.kind == "load":
                    self._load(model, command.name, command.path)
                else:
                    model.delete_adapter(self._internal.pop(command.name))
            except Exception as exc:
                logger.exception("adapter %s of %r failed", command.kind, command.name)
                resolve(command, BadRequest(f"could not {command.kind} adapter {command.name!r}: {exc}"))
            else:
                resolve(command, None)
            finally:
                # Injecting or deleting LoRA layers resets which adapter is active and enabled.
                self._applied_valid = False
        return deferred

    def apply(self, model: Any, name: str | None) -> None:
        """Make ``name`` the active adapter (None: the base model)."""
        if self._applied_valid and self._applied == name:
            return
        if name is None:
            if getattr(model, "_hf_peft_config_loaded", False):
                model.disable_adapters()
        else:
            model.enable_adapters()
            model.set_adapter(self._internal[name])
        self._applied, self._applied_valid = name, True

    def _load(self, model: Any, name: str, path: str) -> None:
        # PEFT module names cannot hold every string a client may use as an adapter name (dots, say), so the
        # model holds each adapter under a fresh internal name.
        internal = f"clawgate_{next(self._ids)}"
        try:
            with _quiet_adapter_loading():
                info = model.load_adapter(path, adapter_name=internal)
            # transformers lists the other adapters' weights as missing too; only this adapter's count.
            marker = f".{internal}."
            problems = [
                *sorted(k for k in info.missing_keys if marker in k),
                *sorted(info.unexpected_keys),
                *(str(k[0]) for k in info.mismatched_keys),
                *info.error_msgs,
            ]
            if problems:
                raise ValueError(f"the adapter does not fit the model: {', '.join(problems[:5])}")
        except Exception:
            # A failed load can leave half-injected layers behind.
            if internal in getattr(model, "peft_config", {}):
                with contextlib.suppress(Exception):
                    model.delete_adapter(internal)
            raise
        model.eval()
        self._internal[name] = internal


class _DropLoadReport(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "LOAD REPORT" not in record.getMessage()


@contextlib.contextmanager
def _quiet_adapter_loading() -> Iterator[None]:
    """Silence what transformers and PEFT print for every additional adapter: a load report listing the other
    adapters' weights as missing, and a warning that the model holds several adapters (both are intended here;
    real problems are checked from the returned load info)."""
    report_logger = logging.getLogger("transformers.integrations.peft")
    report_filter = _DropLoadReport()
    report_logger.addFilter(report_filter)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Already found a `peft_config` attribute")
            yield
    finally:
        report_logger.removeFilter(report_filter)
