import sys

try:
    from orchestrator.cli import main
except KeyboardInterrupt:  # Ctrl-C while the CLI loads: 130 and one line, as anywhere else
    print("\ninterrupted (Ctrl-C)", file=sys.stderr)
    sys.exit(130)

if __name__ == "__main__":
    main()
