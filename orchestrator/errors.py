"""Errors a user can act on. Each carries the process exit code the CLI uses."""
from pathlib import Path


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



def file_error(error: OSError, profiles_dir: str) -> ConfigError:
    """An OSError on a file (a read-only or full profiles folder, a path through a file) as one
    line naming the file and the cause; under the profiles folder, also the setting that moves
    it."""
    if not error.filename:
        return ConfigError(str(error))
    line = f"{error.filename}: {error.strerror or error}"
    if Path(error.filename).resolve().is_relative_to(Path(profiles_dir).resolve()):
        line += (f". The profiles folder {profiles_dir} must be writable: make it so, or choose "
                 f"another with profiles_dir=<folder>")
    return ConfigError(line)


class InvalidLayout(ConfigError):
    """A parallel layout that cannot run on these ranks or this model (exit 2); a `-m` sweep
    skips such a point, with its reason, instead of failing."""
