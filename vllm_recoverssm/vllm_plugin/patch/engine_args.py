"""Command-line and engine-argument handling for the recovery mode.

vLLM's ``--use-replayssm / --no-use-replayssm`` flag defaults to False, so a plain
``vllm serve`` and an explicit ``--no-use-replayssm`` look the same to it. The plugin wraps
three ``EngineArgs`` methods (it calls the originals; it does not replace their logic):

* ``add_cli_args``: the flag's default becomes "unset" (None), so an explicit
  ``--no-use-replayssm`` can be told apart, and its help says what the plugin does;
* ``from_cli_args``: unset -> vLLM's False (mode auto); ``--no-use-replayssm`` -> mode off;
* ``create_engine_config``: ``--use-replayssm`` on a GLM-5.3 model means "force recovery"
  (mode on). vLLM's own ReplaySSM flag would reject GLM-5.3, so the flag is cleared before
  vLLM validates the config; on every other architecture it is left to vLLM. After the
  config is built, the decision is taken, logged once, and a forced but ineligible
  deployment fails here, at start-up, listing every failing condition; so does a KV
  connector that cannot be correct for GLM-5.3 (:mod:`..distributed.kv_connector.startup`).
  Where vLLM cannot give a GLM-5.3 checkpoint an MTP drafter, its error becomes one line
  saying what to change (:mod:`..spec_decode.mtp`).

The mode travels in ``additional_config["recoverssm"]``; from Python (``LLM(...)``) pass
``additional_config={"recoverssm": "off"}`` to opt out, since there ``use_replayssm=False``
is also the default.
"""

from __future__ import annotations

import argparse
import functools
from typing import Any

from ...config import GLM53_ARCHITECTURES, RecoveryMode
from ..config import (
    CONFIG_KEY,
    decide_for_vllm_config,
    is_glm53,
    log_decision_once,
    requested_commit,
)
from ..spec_decode import mtp

FLAG_DEST = "use_replayssm"
HELP_NOTE = (
    "\n\n[vllm-recoverssm] GLM-5.3 with MTP/DFlash uses speculative-state recovery "
    "automatically when eligible; --no-use-replayssm keeps full speculative states and "
    "--use-replayssm forces recovery (start-up fails, listing every reason, when it cannot "
    "be used)."
)
_HOOKED = "_recoverssm_hooked"


def _explicit_mode(extra: dict[str, Any]) -> RecoveryMode | None:
    if CONFIG_KEY not in extra:
        return None
    try:
        return RecoveryMode(str(extra[CONFIG_KEY]).lower())
    except ValueError:
        raise ValueError(
            f"additional_config['{CONFIG_KEY}']: expected one of auto, on, off, got "
            f"{extra[CONFIG_KEY]!r}"
        ) from None


def mark_cli_flag(parser: argparse.ArgumentParser) -> None:
    """Make ``--use-replayssm``'s default None (unset) and describe the plugin in its help."""
    for action in parser._actions:  # argparse has no public accessor for this
        if action.dest == FLAG_DEST:
            if action.help and HELP_NOTE not in action.help:
                action.help += HELP_NOTE
            action.default = None
    parser.set_defaults(**{FLAG_DEST: None})


def apply_cli_flag(engine_args: Any, value: bool | None) -> None:
    """Turn the parsed flag into vLLM's boolean plus our mode (see the module docstring)."""
    extra = dict(engine_args.additional_config or {})
    explicit = _explicit_mode(extra)
    if value is False:
        if explicit not in (None, RecoveryMode.OFF):
            raise ValueError(
                f"--no-use-replayssm contradicts additional_config['{CONFIG_KEY}']="
                f"{explicit.value!r}"
            )
        extra[CONFIG_KEY] = RecoveryMode.OFF.value
        engine_args.additional_config = extra
    engine_args.use_replayssm = bool(value)


def _architecture(engine_args: Any) -> str | None:
    try:
        return engine_args.create_model_config().architecture
    except Exception:  # vLLM reports a bad model itself when it builds the config
        return None


def apply_force_flag(engine_args: Any) -> None:
    """``use_replayssm=True`` on GLM-5.3 -> mode on, and vLLM's own flag cleared."""
    if not engine_args.use_replayssm:
        return
    extra = dict(engine_args.additional_config or {})
    explicit = _explicit_mode(extra)
    if _architecture(engine_args) not in GLM53_ARCHITECTURES:
        return  # vLLM's own ReplaySSM / RecoverSSM (e.g. Kimi) handles the flag
    if explicit not in (None, RecoveryMode.ON):
        raise ValueError(
            f"--use-replayssm contradicts additional_config['{CONFIG_KEY}']="
            f"{explicit.value!r}"
        )
    extra[CONFIG_KEY] = RecoveryMode.ON.value
    engine_args.additional_config = extra
    engine_args.use_replayssm = False


def check_at_startup(vllm_config: Any) -> None:
    """Decide, log once, and raise ``IneligibleError`` for a forced ineligible deployment;
    refuse a KV connector that cannot be correct here (one line naming why)."""
    from ..distributed.kv_connector.startup import check_kv_connector

    check_kv_connector(vllm_config)
    requested_commit(vllm_config)  # a bad commit mode fails here, naming the key
    decision = decide_for_vllm_config(vllm_config)
    if is_glm53(vllm_config):
        log_decision_once(vllm_config, decision)


def install() -> None:
    """Wrap ``EngineArgs``'s methods (idempotent).

    Imported here rather than only where vLLM already has it: a process that loads
    plugins before its engine arguments would otherwise miss the hooks. After vLLM's
    config package (always loaded by then) the import costs a few tens of milliseconds.
    """
    from ..compat import EngineArgs

    engine_args_cls: Any = EngineArgs
    if getattr(engine_args_cls, _HOOKED, False):
        return

    original_add = engine_args_cls.add_cli_args
    original_from = vars(engine_args_cls)["from_cli_args"].__func__
    original_create = engine_args_cls.create_engine_config

    @functools.wraps(original_add)
    def add_cli_args(parser: Any) -> Any:
        parser = original_add(parser)
        mark_cli_flag(parser)
        return parser

    @functools.wraps(original_from)
    def from_cli_args(cls: type, args: argparse.Namespace) -> Any:
        value = getattr(args, FLAG_DEST, None)
        if hasattr(args, FLAG_DEST):
            setattr(args, FLAG_DEST, bool(value))
        engine_args = original_from(cls, args)
        apply_cli_flag(engine_args, value)
        return engine_args

    @functools.wraps(original_create)
    def create_engine_config(self: Any, *args: Any, **kwargs: Any) -> Any:
        apply_force_flag(self)
        try:
            vllm_config = original_create(self, *args, **kwargs)
        except (NotImplementedError, AttributeError) as exc:
            clear = mtp.explain(self, exc)
            if clear is None:
                raise
            raise clear from exc
        check_at_startup(vllm_config)
        return vllm_config

    engine_args_cls.add_cli_args = staticmethod(add_cli_args)
    engine_args_cls.from_cli_args = classmethod(from_cli_args)
    engine_args_cls.create_engine_config = create_engine_config
    setattr(engine_args_cls, _HOOKED, True)
