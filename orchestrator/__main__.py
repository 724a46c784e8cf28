import gc
import sys

from orchestrator.startup import collector_paused

try:
    with collector_paused():  # Hydra, OmegaConf, rich, ours: ~50k objects, as long as the command
        from orchestrator.cli import main
except KeyboardInterrupt:  # Ctrl-C while the CLI loads: 130 and one line, as anywhere else
    print("\ninterrupted (Ctrl-C)", file=sys.stderr)
    sys.exit(130)

if __name__ == "__main__":
    try:
        main()
    finally:
        # No collection at exit: a stage run in this process (an analytic profile, a trace)
        # leaves torch's ~350k objects, whose last sweep took 1 s of every such command.
        gc.freeze()
