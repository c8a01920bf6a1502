"""The error codes of the wire (``contract.errors``): each has its status and whom it blames, the router's
verdict reads its sets of codes off that table, and no product module writes a code as a literal."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from contract.errors import RULES, TYPED_FIELDS, Blame, Code, blaming, rule_of
from router.dispatch import verdict

REPO = Path(__file__).resolve().parents[2]
PRODUCT = ("router", "stages", "cache", "transfer", "process", "bench", "cli", "telemetry")
# a code's value written where it is not a code: a metric label, a health body's status, a column, a field name
NOT_A_CODE = {
    ("router/metrics.py", "internal_error"),  # an outcome label of epd_router_requests_total
    ("router/app.py", "internal_error"),  # the same label, set by the route
    ("router/fleet/discovery.py", "draining"),  # /health's {"status": "draining"}
    ("router/fleet/membership.py", "draining"),  # a worker's field in /admin/workers
    ("cli/admin.py", "draining"),  # that field, read by `stage admin workers`
    ("bench/ratio_shift/client.py", "draining"),  # that field, sampled by bench.ratio_shift
    ("bench/ratio_shift/analysis.py", "draining"),  # and read there
}


@pytest.mark.unit
def test_every_code_has_a_status_and_a_blame():
    assert set(RULES) == set(Code)
    for code in Code:
        assert 400 <= code.status < 600 and isinstance(code.blame, Blame), code
        assert code.value == code.name.lower()


@pytest.mark.unit
def test_a_client_code_is_a_4xx_and_a_5xx_blames_someone_else():
    for code in Code:
        if code.blame is Blame.CLIENT:
            assert code.status < 500, code
        if code.blame in (Blame.STAGE, Blame.PEER, Blame.DECODE, Blame.SHARED, Blame.BUSY, Blame.LEAVING):
            assert code.status >= 500, code
    assert {code for code in Code if code.status == 503} >= blaming(Blame.BUSY, Blame.LEAVING, Blame.SHARED)


@pytest.mark.unit
def test_the_routers_verdict_sets_are_the_tables():
    """The sets ``router.dispatch.verdict`` acts on, as they were written there before the table."""
    assert verdict.PEER_CODES == {"peer_failed", "room_timeout"}
    assert verdict.DECODE_SIDE_CODES == {"peer_failed", "room_timeout", "kv_transfer_failed"}
    assert verdict.ROUTER_CODES == {"room_conflict", "bootstrap_not_allowed"}
    assert verdict.SHARED_CODES == {"cache_unavailable"}
    assert verdict.IMAGE_CODES == {"encode_failed", "encode_abandoned", "embedding_timeout", "image_not_cached"}
    assert verdict.LEAVING_CODES == {"draining", "drain_timeout"}


@pytest.mark.unit
@pytest.mark.parametrize("code, status", [
    ("peer_failed", 502), ("room_timeout", 504), ("engine_error", 500), ("internal_error", 500),
    ("engine_unavailable", 503), ("kv_pool_full", 503), ("unhealthy", 503), ("server_overloaded", 503),
    ("draining", 503), ("drain_timeout", 503), ("embedding_timeout", 504),
    ("image_not_cached", 502), ("invalid_value", 502), ("no_such_code", 502), (None, 502),  # not a 5xx: 502
])
def test_an_in_band_error_event_stands_for_its_codes_5xx(code, status):
    body = {"error": {"message": "m", **({"code": code} if code else {})}}
    assert verdict.from_event("decode", "http://d:1", body).status == status


@pytest.mark.unit
def test_a_code_read_off_the_wire_finds_its_rule():
    assert rule_of("peer_failed") == RULES[Code.PEER_FAILED] and rule_of("nope") is None and rule_of(None) is None
    assert {Code.PEER_FAILED: 1}["peer_failed"] == 1 and "peer_failed" in verdict.PEER_CODES  # a str, hashed as one


@pytest.mark.unit
def test_the_typed_fields_are_four_in_this_order():
    assert TYPED_FIELDS == ("stage", "room", "image_key", "peer_code")


def _literals(path: Path) -> list[tuple[int, str]]:
    """The string constants of ``path`` that are not docstrings."""
    tree = ast.parse(path.read_text())
    docs = {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    return [(node.lineno, node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs]


def test_no_product_module_writes_a_code_of_the_contract_as_a_literal():
    values = {code.value for code in Code}
    found = [f"{path.relative_to(REPO)}:{line}: {text!r}" for package in PRODUCT
             for path in sorted((REPO / package).rglob("*.py"))
             for line, text in _literals(path)
             if text in values and (str(path.relative_to(REPO)), text) not in NOT_A_CODE]
    assert not found, "write Code.X (contract.errors) instead of:\n" + "\n".join(found)


@pytest.mark.unit
def test_the_check_finds_a_literal():
    """Negative control: the scan sees a code written as a literal (and skips docstrings)."""
    source = REPO / "contract" / "errors.py"
    assert (0, "peer_failed") not in _literals(source)
    assert any(text == "peer_failed" for _, text in _literals(source))  # Code.PEER_FAILED's own value
