"""`python -m orchestrator.runtime <request.pkl>`: what mpiexec starts on every local rank."""
import sys

from orchestrator.runtime import die_with_rank_shell, run_rank
from orchestrator.runtime.request import StageRequest

if __name__ == "__main__":
    die_with_rank_shell()
    try:
        run_rank(StageRequest.load(sys.argv[1]))
    except BaseException:
        sys.exit(1)  # run_rank already logged the error and told the other ranks
