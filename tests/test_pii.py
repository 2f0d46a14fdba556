"""PII detection and redaction (server/shared/pii.py): what is found, what is left alone, real queries."""

from __future__ import annotations

import csv
import re
from itertools import pairwise
from pathlib import Path

import pytest

from server.shared import pii

BANKING77 = Path(__file__).resolve().parent.parent / "bench" / "data" / "banking77" / "train.csv"

POSITIVES = {
    "email": [
        "a.b@example.com", "john.smith+tag@mail.sub-domain.example.co.uk", "x_y-z@corp.io",
        "USER99@Example.ORG",
    ],
    "iban": [
        "GB82 WEST 1234 5698 7654 32", "GB82WEST12345698765432", "gb82west12345698765432",
        "DE89 3704 0044 0532 0130 00", "DE89370400440532013000", "NO9386011117947",
        "FR14 2004 1010 0505 0001 3M02 606",
    ],
    "card": [
        "4111 1111 1111 1111", "4111-1111-1111-1111", "4111111111111111", "5555-5555-5555-4444",
        "5555 5555 5555 4444", "378282246310005", "3782 822463 10005", "6011111111111117",
        "4222222222222", "2223003122003222", "3530111333300000",
    ],
    "national_id": [
        "123-45-6789", "123 45 6789", "078-05-1120", "QQ 12 34 56 C", "QQ123456C", "AB 12 34 56 D",
        "ab123456c", "JG103759A",
    ],
    "ip": [
        "192.168.0.1", "10.0.0.255", "8.8.8.8", "2001:db8::1", "fe80::1ff:fe23:4567:890a",
        "2001:0db8:85a3:0000:0000:8a2e:0370:7334", "::ffff:192.0.2.1", "::1",
    ],
    "phone": [
        "+44 20 7946 0958", "+1 (415) 555-2671", "+1-415-555-2671", "+33 1 23 45 67 89",
        "+44 (0)20 7946 0958", "+49.30.1234567", "(415) 555-2671", "415-555-2671", "415.555.2671",
        "4155552671", "1-800-555-1234", "020 7946 0958", "07700 900123", "07700900123",
        "0161 496 0000",
    ],
}

NEGATIVES = [
    "4111 1111 1111 1112", "4111111111111112", "ts 20230105123045", "id 1000000000000008", "1234 5678 9012 3456", "5555-5555-5555-4445",
    "GB83 WEST 1234 5698 7654 32", "GB82WEST12345698765433",  # IBAN check digits wrong
    "it cost $1,000", "I paid 100.50 yesterday", "top up 2500 please", "top up 50", "in 2024",
    "on 12/05/2023", "on 2023-01-05", "on 05-01-2023", "at 10:30", "at 10:30:45", "PIN 1234",
    "code 123456", "order 12345", "order number 98765432", "version 1.2.3.4.5", "v2.10.3",
    "ip 256.1.1.1", "reply to: support", "ratio 3:2", "std::vector", "a :: b",
    "000-12-3456", "666-12-3456", "912-12-3456", "123-00-4567", "123-45-0000",  # invalid SSNs
    "DA 12 34 56 C", "AB 12 34 56 E",  # NI prefix D / suffix E are never issued
    "user@localhost", "a@b", "@handle", "email me at",
    "balance +2500", "up +12.50 today", "+1 234 567 on 2024-01-05", "I was charged 3 times for 19.99", "3D Secure", "€1 fee", "7,000 pounds", "1L",
]


def _kinds(text):
    return [kind for _, _, kind in pii.find(text)]


def _disjoint_and_sorted(spans):
    return all(a_end <= b_start for (_, a_end, _), (b_start, _, _) in pairwise(spans))


@pytest.mark.parametrize("kind, value", [(k, v) for k, values in POSITIVES.items() for v in values])
def test_each_format_is_found_whole_and_redacted(kind, value):
    text = f"my details: {value}, thanks"
    start = text.index(value)
    assert pii.find(text) == [(start, start + len(value), kind)]
    assert pii.redact(text) == f"my details: {pii.PLACEHOLDERS[kind]}, thanks"
    assert pii.contains_pii(text) and pii.contains_pii(value)
    assert pii.redact(value) == pii.PLACEHOLDERS[kind]  # also at the very start and end


@pytest.mark.parametrize("text", NEGATIVES)
def test_non_pii_is_left_byte_identical(text):
    assert pii.find(text) == []
    assert not pii.contains_pii(text)
    assert pii.redact(text) == text


def test_kinds_and_placeholders_cover_each_other():
    assert pii.KINDS == ("email", "iban", "card", "national_id", "ip", "phone")
    assert set(pii.PLACEHOLDERS) == set(pii.KINDS)
    assert all(pii.find(p) == [] for p in pii.PLACEHOLDERS.values())  # redaction is idempotent


def test_two_cards_redact_to_the_same_digit_free_text():
    visa = pii.redact("my card 4111 1111 1111 1111 was declined")
    mastercard = pii.redact("my card 5555 5555 5555 4444 was declined")
    assert visa == mastercard == "my card [card number] was declined"
    assert not re.search(r"[0-9]", visa)


def test_text_without_pii_is_unchanged():
    for text in ["How do I return an item?", "", "Ｈｏｗ ｄｏ Ｉ？", "why was I charged $1 extra?",
                 "I sent 500 to my friend 2 days ago", "meet at 10:30 on 2023-01-05"]:
        assert pii.redact(text) == text and not pii.contains_pii(text)


def test_several_kinds_in_one_text_do_not_overlap():
    text = ("Mail a.b@example.com or call +44 20 7946 0958 / (415) 555-2671; card 4111-1111-1111-1111, "
            "IBAN GB82 WEST 1234 5698 7654 32, SSN 123-45-6789, NI QQ 12 34 56 C, from 10.0.0.1 "
            "and 2001:db8::1.")
    spans = pii.find(text)
    assert [kind for _, _, kind in spans] == [
        "email", "phone", "phone", "card", "iban", "national_id", "national_id", "ip", "ip"]
    assert _disjoint_and_sorted(spans)
    redacted = pii.redact(text)
    assert not re.search(r"[0-9@]", redacted.replace("[", "").replace("]", "")), redacted
    assert redacted.endswith("from [ip address] and [ip address].")


def test_earlier_kinds_win_overlaps_and_long_runs_keep_the_valid_part():
    assert _kinds("4111 1111 1111 1111") == ["card"]
    assert _kinds("+1 4111 1111 1111 1111") == ["card"]  # "+1 4111 1111 1111" is also phone-shaped
    assert _kinds("john.4155552671@example.com") == ["email"]
    assert _kinds("GB82 WEST 1234 5698 7654 32") == ["iban"]
    assert pii.redact("card 4111 1111 1111 1111 2023") == "card [card number] 2023"
    assert pii.redact("GB82 WEST 1234 5698 7654 32 from me") == "[iban] from me"
    assert pii.redact("call 020 7946 0958 2 times") == "call [phone number] 2 times"
    assert pii.redact("IP:2001:db8::1 ok") == "IP:[ip address] ok"
    assert pii.redact("a version 1.2.3.4.5 and host 1.2.3.4") == "a version 1.2.3.4.5 and host [ip address]"


def test_non_ascii_digits_do_not_count():
    arabic_indic = "٤١١١ ١١١١ ١١١١ ١١١١"  # 4111 1111 1111 1111 in Arabic-Indic digits; NFKC keeps them
    assert pii.find(arabic_indic) == [] and pii.redact(arabic_indic) == arabic_indic


def test_pathological_inputs_finish():
    for unit in ["1", "1 ", "a.", "a@", ":", "1:", "+1 ", "0 ", "ABCD ", "1.", "ab12 ", "f:"]:
        text = unit * (20000 // len(unit))  # linear patterns: each returns in milliseconds
        spans = pii.find(text)
        assert all(0 <= s < e <= len(text) for s, e, _ in spans)
        assert _disjoint_and_sorted(spans)


def test_banking77_queries_are_almost_never_changed():
    if not BANKING77.is_file():
        pytest.skip(f"{BANKING77} is absent")
    with BANKING77.open(newline="", encoding="utf-8") as f:
        texts = [row["text"] for row in csv.DictReader(f)]
    assert len(texts) > 1000
    changed = [(t, pii.redact(t)) for t in texts if pii.redact(t) != t]
    for before, after in changed:
        print(f"{before!r} -> {after!r}")
    assert len(changed) <= 0.01 * len(texts), changed[:20]
    assert sum(pii.contains_pii(t) for t in texts) == len(changed)
