"""The full vLLM audit: 1000 requests at seed 11 through vLLM's own managers and connectors (issue 12).

Prints the audit table, seconds per request against the 10-minute budget, and
whether the deviation classes are the ones docs/explanation/vllm-audit.json
(and so the findings page) documents. ``--write-json`` regenerates that file
at its committed count (200 requests, a quarter as many again on
state-group configs and a tenth with different speculation on the two
engines), which tests/test_vllm_integration.py compares with a fresh run.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from kvspec.integrations._vllm_versions import expected_file_stem
from kvspec.integrations.vllm_audit import AUDIT_CONNECTORS, run_audit

# One committed audit per verified vLLM release: vllm-audit.json (0.33.0), vllm-audit-0.34.json (0.34.0).
COMMITTED = (
    Path(__file__).resolve().parent.parent / "docs" / "explanation" / (expected_file_stem("vllm-audit") + ".json")
)
COMMITTED_REQUESTS = 200
BUDGET_S = 600.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument(
        "--write-json", action="store_true", help=f"rewrite {COMMITTED.name} ({COMMITTED_REQUESTS} requests)"
    )
    args = parser.parse_args()
    if args.write_json:
        report = run_audit(connectors=AUDIT_CONNECTORS, requests=COMMITTED_REQUESTS, seed=args.seed)
        report.write_json(COMMITTED)
        print(report.render())
        print(f"wrote {COMMITTED}")
        return 0
    started = time.perf_counter()
    report = run_audit(connectors=AUDIT_CONNECTORS, requests=args.requests, seed=args.seed)
    seconds = time.perf_counter() - started
    print(report.render())
    drives = (args.requests + report.state_requests + report.speculation_requests) * len(AUDIT_CONNECTORS)
    print(
        f"{args.requests} + {report.state_requests} state + {report.speculation_requests} speculation requests x "
        f"{len(AUDIT_CONNECTORS)} connectors in "
        f"{seconds:.1f}s: "
        f"{1000 * seconds / drives:.1f} ms per request, {seconds / BUDGET_S:.2f} of the {BUDGET_S:.0f}s budget"
    )
    documented = {(c["connector"], c["class"]) for c in json.loads(COMMITTED.read_text())["classes"]}
    found = {(c.connector, c.deviation) for c in report.classes}
    print(f"reference connector deviations: {report.deviations('reference')}")
    if found != documented:
        print(
            f"classes differ from {COMMITTED.name}: new {sorted(found - documented)}, gone {sorted(documented - found)}"
        )
        return 1
    print(f"deviation classes match {COMMITTED.name} and the findings page")
    return 0


if __name__ == "__main__":
    sys.exit(main())
