import gc
import sys

# The CLI's imports (Hydra, OmegaConf, rich, ours: ~50k objects that live as long as the
# command) without garbage collections, and kept out of later ones.
gc.disable()
try:
    from orchestrator.cli import main
except KeyboardInterrupt:  # Ctrl-C while the CLI loads: 130 and one line, as anywhere else
    print("\ninterrupted (Ctrl-C)", file=sys.stderr)
    sys.exit(130)
gc.freeze()
gc.enable()

if __name__ == "__main__":
    try:
        main()
    finally:
        # No collection at exit: a stage run in this process (an analytic profile, a trace)
        # leaves torch's ~350k objects, whose last sweep took 1 s of every such command.
        gc.freeze()
