"""Verifiable environments: the protocol (``base``) and the built-ins."""

from pipeline.rollout.envs.base import (Demonstrating, Environment, Stateful, Task, ToolError, ToolTimeout, Verification,
                                        env_class, get_env, list_envs, register_env, split_of)
from pipeline.rollout.envs import arithmetic as _arithmetic  # noqa: F401  (registers arithmetic-tool, arithmetic-chain)
from pipeline.rollout.envs import reverse as _reverse  # noqa: F401  (registers reverse-digits)
from pipeline.rollout.envs import flaky as _flaky  # noqa: F401  (registers flaky-tool)
from pipeline.rollout.envs import sql as _sql  # noqa: F401  (registers sql-agent)
from pipeline.rollout.envs import relay as _relay  # noqa: F401  (registers tool-relay)

__all__ = ["Demonstrating", "Environment", "Stateful", "Task", "ToolError", "ToolTimeout", "Verification", "env_class", "get_env", "list_envs",
           "register_env", "split_of"]
