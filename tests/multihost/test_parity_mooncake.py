"""2E2P2D over Mooncake, every stage on its own host of the rig: the cases of ``parity_cases``."""

from tests.multihost.parity_cases import (  # noqa: F401 - collected here, with this module's TRANSFER
    blocks_back_to_zero, reference, stack, test_a_poser_outside_allowed_bootstrap_is_403_and_never_dialed,
    test_every_prefill_decode_pair_serves, test_no_wildcard_listener_on_any_host, test_router_answer_equals_generate,
    test_the_admin_api_from_the_client_host_needs_the_token,
    test_the_redis_password_shows_in_no_log_metric_info_or_error_body)

TRANSFER = "mooncake"
