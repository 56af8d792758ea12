"""Webhook targets and signatures: internal addresses refused unless the operator
names the host, every resolved address checked, the delivery pinned to the address checked."""

from __future__ import annotations

import pytest

from corral.batch.webhooks import WebhookRefused, check_url, sign


def dns(table: dict[str, list[str]]):  # type: ignore[no-untyped-def]
    def lookup(host: str, port: int) -> list[str]:
        if host not in table:
            raise OSError("Name or service not known")
        return table[host]

    return lookup


PUBLIC = dns({"hooks.example": ["93.184.215.14"], "v6.example": ["2606:2800:21f:cb07::1"]})


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("http://127.0.0.1:8080/x", "loopback"),
        ("http://127.1/x", "loopback"),
        ("http://[::1]/x", "loopback"),
        ("http://169.254.169.254/latest/meta-data", "link-local"),
        ("http://10.0.0.5/x", "private"),
        ("http://192.168.1.1/x", "private"),
        ("http://[fd00::1]/x", "private"),
        ("http://[::ffff:127.0.0.1]/x", "loopback"),
        ("http://224.0.0.1/x", "multicast"),
        ("http://0.0.0.0/x", "unspecified"),
    ],
)
def test_internal_addresses_are_refused_by_default(url: str, why: str) -> None:
    with pytest.raises(WebhookRefused, match=why):
        check_url(url, [])


def test_a_name_is_refused_if_any_of_its_addresses_is_internal() -> None:
    lookup = dns({"rebind.example": ["93.184.215.14", "127.0.0.1"]})
    with pytest.raises(WebhookRefused, match=r"'rebind\.example' is 127\.0\.0\.1, a loopback"):
        check_url("https://rebind.example/hook", [], lookup)


def test_a_public_name_is_pinned_to_the_address_checked() -> None:
    t = check_url("https://hooks.example/a/b?x=1", [], PUBLIC)
    assert t.url == "https://93.184.215.14:443/a/b?x=1"
    assert (t.host, t.address) == ("hooks.example", "93.184.215.14")
    t6 = check_url("http://v6.example:8080", [], PUBLIC)
    assert t6.url == "http://[2606:2800:21f:cb07::1]:8080/"


def test_named_hosts_may_be_internal_and_nothing_else_is_allowed_then() -> None:
    t = check_url("http://127.0.0.1:9000/done", ["127.0.0.1"], PUBLIC)
    assert t.url == "http://127.0.0.1:9000/done"
    with pytest.raises(WebhookRefused, match=r"not allowed \(batch.webhook_hosts: 127.0.0.1\)"):
        check_url("https://hooks.example/x", ["127.0.0.1"], PUBLIC)


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("ftp://hooks.example/x", "http"),
        ("file:///etc/passwd", "http"),
        ("http://user:pw@hooks.example/x", "credentials"),
        ("http://nowhere.example/x", "does not resolve"),
        ("http://hooks.example:99999/x", "bad port"),
        ("http://[/x", "not a URL"),  # found by tests/unit/test_fuzz_parsers.py
    ],
)
def test_bad_urls_say_what_is_wrong(url: str, why: str) -> None:
    with pytest.raises(WebhookRefused, match=why):
        check_url(url, [], PUBLIC)


def test_signature_matches_the_standard_webhooks_reference() -> None:
    # The test vector of the Standard Webhooks reference libraries (standard-webhooks/libraries).
    got = sign(
        "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw",
        "msg_p5jXN8AQM9LWM0D4loKWxJek",
        1614265330,
        b'{"test": 2432232314}',
    )
    assert got == "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="
