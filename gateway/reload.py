"""Hot reload: the config file, re-read on SIGHUP or when it changes, validated whole
and put in force between requests, or refused with the last good config kept.

Thresholds, deadlines, tenants, keys, limits and the cache's and loop's tuning change
while serving. What the process was built from (engines, embedder, the router's
model, the cache's store and index, where it listens) needs a restart: a file that
changes any of it is refused as a whole, so a reload never half-applies.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from gateway.config import ConfigError, GatewayConfig, load_config
from gateway.config.shadow import ShadowSettings
from gateway.ops.keys import KeyTable
from gateway.runtime import Runtime

log = logging.getLogger("satisfice.gateway")

Trigger = Literal["SIGHUP", "file change"]

# What a running process was built from, by the key an SRE would look for.
_RESTART_ONLY: dict[str, Callable[[GatewayConfig], Any]] = {
    "server.host": lambda c: c.server.host,
    "server.port": lambda c: c.server.port,
    "server.max_body_bytes": lambda c: c.server.max_body_bytes,
    "server.log_format": lambda c: c.server.log_format,
    "server.access_log": lambda c: c.server.access_log,
    "server.watch_interval_s": lambda c: c.server.watch_interval_s,
    "server.header_timeout_s": lambda c: c.server.header_timeout_s,
    "server.body_timeout_s": lambda c: c.server.body_timeout_s,
    "server.body_min_rate": lambda c: c.server.body_min_rate,
    "server.keep_alive_timeout_s": lambda c: c.server.keep_alive_timeout_s,
    "server.max_header_bytes": lambda c: c.server.max_header_bytes,
    "models_dir": lambda c: c.models_dir,
    "engines": lambda c: c.engines,
    "embedder": lambda c: c.embedder,
    "router (on or off)": lambda c: c.router is None,
    "router.model_file": lambda c: c.router and c.router.model_file,
    "router.small_engine": lambda c: c.router and c.router.small_engine,
    "router.large_engine": lambda c: c.router and c.router.large_engine,
    "cache (on or off)": lambda c: c.cache is None,
    "cache.store": lambda c: c.cache and c.cache.store,
    "cache.index": lambda c: c.cache and c.cache.index,
    "cache.verifier": lambda c: c.cache and c.cache.verifier,
    "loop (on or off)": lambda c: c.loop is None,
    "loop.calibrator": lambda c: c.loop and c.loop.calibrator,
    # The file is read at the start, and only with greedy_first on: turning that on
    # with a calibrator needs a restart too.
    "loop.greedy_calibrator": lambda c: c.loop and c.loop.greedy_calibrator_in_use(),
    "auth.rate_limit_url": lambda c: c.auth.rate_limit_url,
    "telemetry": lambda c: c.telemetry,
    # Where checks and policy versions are kept; the shares and limits change hot.
    "shadow.outcomes_file": lambda c: _shadow(c).outcomes_file,
    "shadow.outcomes_max_bytes": lambda c: _shadow(c).outcomes_max_bytes,
    "shadow.stream_max_records": lambda c: _shadow(c).stream_max_records,
}


def _shadow(config: GatewayConfig) -> ShadowSettings:
    return config.shadow or ShadowSettings()


def restart_needed(old: GatewayConfig, new: GatewayConfig) -> list[str]:
    """The keys whose change only a restart can apply."""
    return [key for key, read in _RESTART_ONLY.items() if read(old) != read(new)]


class Reloader:
    """Reloads ``path`` into ``runtime``; ``adjust`` re-applies what the command line
    set over the file (host and port), so a reload keeps it."""

    def __init__(
        self,
        runtime: Runtime,
        path: Path,
        adjust: Callable[[GatewayConfig], GatewayConfig] = lambda config: config,
    ) -> None:
        self._runtime = runtime
        self._path = path
        self._adjust = adjust
        self._lock = asyncio.Lock()
        self._seen: bytes | None = None  # digest of the file as last read

    async def reload(self, trigger: Trigger) -> bool:
        """True when the file's config is now in force."""
        async with self._lock:  # a SIGHUP and the watcher may arrive together
            try:
                config, keys = await asyncio.to_thread(self._load)
                stuck = restart_needed(self._runtime.config, config)
                if stuck:
                    raise ConfigError(
                        f"{self._path}: changes {', '.join(stuck)}, which only a restart applies"
                    )
            except ConfigError as exc:
                self._runtime.metrics.reloaded(ok=False)
                log.error("config reload (%s) refused, the last good config stays: %s",
                          trigger, exc)  # fmt: skip
                return False
            except Exception:  # a bug must not end the watcher or take the process down
                self._runtime.metrics.reloaded(ok=False)
                log.exception("config reload (%s) failed, the last good config stays", trigger)
                return False
            changed = _changed(self._runtime.config, config)
            self._runtime.apply(config, keys)
            self._runtime.metrics.reloaded(ok=True)
            log.info("config reloaded (%s) from %s: %s", trigger, self._path,
                     ", ".join(changed) or "no changes")  # fmt: skip
            return True

    async def watch(self, interval_s: float) -> None:
        """Reload whenever the file's bytes change (an edit, a replaced ConfigMap)."""
        self._seen = await asyncio.to_thread(self._digest)
        while True:
            await asyncio.sleep(interval_s)
            digest = await asyncio.to_thread(self._digest)
            if digest is not None and digest != self._seen:
                self._seen = digest
                await self.reload("file change")

    def _load(self) -> tuple[GatewayConfig, KeyTable]:
        self._seen = self._digest()
        config = self._adjust(load_config(self._path))
        return config, KeyTable(config.auth, config.server.admin_key, os.environ)

    def _digest(self) -> bytes | None:
        try:
            return hashlib.sha256(self._path.read_bytes()).digest()
        except OSError:
            return None  # gone for a moment while an editor or kubelet replaces it


def _changed(old: GatewayConfig, new: GatewayConfig) -> list[str]:
    """The top-level sections that differ, for the log line."""
    return [
        name for name in GatewayConfig.__struct_fields__ if getattr(old, name) != getattr(new, name)
    ]


def start_reloading(
    runtime: Runtime,
    path: Path | None,
    adjust: Callable[[GatewayConfig], GatewayConfig] = lambda config: config,
) -> Callable[[], None]:
    """Reload on SIGHUP and, every server.watch_interval_s, on a changed file; the
    function returned stops both. Without a file (the embedded default) a SIGHUP
    only says there is nothing to reload: its default action would end the process."""
    loop = asyncio.get_running_loop()
    tasks: set[asyncio.Task[object]] = set()
    if path is None:
        loop.add_signal_handler(
            signal.SIGHUP, log.warning, "SIGHUP: the embedded default config has no file to reload"
        )
    else:
        reloader = Reloader(runtime, path, adjust)

        def on_sighup() -> None:
            task = asyncio.create_task(reloader.reload("SIGHUP"))
            tasks.add(task)
            task.add_done_callback(tasks.discard)

        loop.add_signal_handler(signal.SIGHUP, on_sighup)
        interval = runtime.config.server.watch_interval_s
        if interval is not None:
            tasks.add(asyncio.create_task(reloader.watch(interval)))

    def stop() -> None:
        loop.remove_signal_handler(signal.SIGHUP)
        for task in tasks:
            task.cancel()

    return stop
