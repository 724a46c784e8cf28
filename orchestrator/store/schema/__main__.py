"""`python -m orchestrator.store.schema --markdown`: print docs/profile-schema.md."""
import sys

from orchestrator.store.schema.docs import markdown

if __name__ == "__main__":
    if sys.argv[1:] != ["--markdown"]:
        sys.exit("usage: python -m orchestrator.store.schema --markdown > docs/profile-schema.md")
    sys.stdout.write(markdown())
