"""Errors a user can act on. Each carries the process exit code the CLI uses."""


class OrchestratorError(Exception):
    """Base class: the message says what is wrong and what to run next."""

    exit_code = 1


class ConfigError(OrchestratorError):
    """Invalid configuration or layout, caught before anything is launched or submitted."""

    exit_code = 2


class ProfileError(OrchestratorError):
    """A profile file is missing, corrupt or stale; the message names the command that rebuilds it."""

    exit_code = 4


class LaunchError(OrchestratorError):
    """A launched stage failed: a rank died, the job was cancelled, or MPI was set up wrong."""

    exit_code = 5


class InfeasibleError(OrchestratorError):
    """No layout fits the memory budget (raised by search)."""

    exit_code = 3
