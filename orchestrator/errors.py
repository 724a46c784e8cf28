"""Errors a user can act on. Each carries the process exit code the CLI uses."""
import errno
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



def file_error(error: OSError, profiles_dir: str, need: str = "") -> ConfigError:
    """An OSError on a file (a read-only or full profiles folder, a path through a file) as one
    line naming the file and the cause; under the profiles folder, also the setting that moves
    it. On a full disk (or quota), also the room left there and `need`: what the command
    writes (e.g. "profile_hardware writes about 120 KiB")."""
    if not error.filename:
        return ConfigError(str(error))
    line = f"{error.filename}: {error.strerror or error}"
    inside = Path(error.filename).resolve().is_relative_to(Path(profiles_dir).resolve())
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        room = ", ".join(filter(None, [_free_text(Path(error.filename)), need]))
        line += f" ({room})" if room else ""
        if inside:
            line += (f". Make room in the profiles folder {profiles_dir}, or choose another "
                     f"with profiles_dir=<folder>")
    elif inside:
        line += (f". The profiles folder {profiles_dir} must be writable: make it so, or choose "
                 f"another with profiles_dir=<folder>")
    return ConfigError(line)


def size_text(n_bytes: float) -> str:
    """A byte count for a message: `512 B`, `40 KiB`, `3.2 MiB`, `1.5 GiB`."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n_bytes >= scale:
            value = n_bytes / scale
            return f"{value:.1f} {unit}" if value < 10 else f"{value:.0f} {unit}"
    return f"{n_bytes:.0f} B"


def _free_text(path: Path) -> str:
    """'<size> free there' for the file system holding `path` (its nearest existing folder)."""
    import shutil

    folder = path.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        return f"{size_text(shutil.disk_usage(folder).free)} free there"
    except OSError:
        return ""


class InvalidLayout(ConfigError):
    """A parallel layout that cannot run on these ranks or this model (exit 2); a `-m` sweep
    skips such a point, with its reason, instead of failing."""
