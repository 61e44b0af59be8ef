"""A peer's ``Retry-After`` read once for the whole mesh (``errors.retry_after_seconds``): a number
of seconds or an HTTP date (RFC 9110), bounded to the protocol's 1 to 60 s, 1 when unreadable."""

from __future__ import annotations

import email.utils
import time

import pytest

from nemo_gym_ckpt.errors import MAX_RETRY_AFTER_S, retry_after_seconds

pytestmark = pytest.mark.unit

NOW = 1_800_000_000.0


def _date(offset_s: float) -> str:
    return email.utils.formatdate(NOW + offset_s, usegmt=True)


@pytest.mark.parametrize(("value", "seconds"), [
    ("7", 7.0), (" 7 ", 7.0), ("2.5", 2.5), ("0", 1.0), ("-4", 1.0), ("3600", MAX_RETRY_AFTER_S),
    ("inf", MAX_RETRY_AFTER_S), ("nan", 1.0), (None, 1.0), ("", 1.0), ("soon", 1.0), ("9" * 65, 1.0),
])
def test_a_number_of_seconds_is_bounded_to_one_to_sixty(value: str | None, seconds: float) -> None:
    assert retry_after_seconds(value, now=NOW) == seconds


@pytest.mark.parametrize(("offset_s", "seconds"), [(17, 17.0), (0, 1.0), (-30, 1.0), (86_400, MAX_RETRY_AFTER_S)])
def test_an_http_date_is_the_seconds_until_it(offset_s: float, seconds: float) -> None:
    assert retry_after_seconds(_date(offset_s), now=NOW) == seconds


def test_each_of_the_three_http_date_forms_is_read() -> None:
    moment = time.gmtime(NOW + 30)
    forms = [time.strftime(form, moment) for form in (
        "%a, %d %b %Y %H:%M:%S GMT",  # IMF-fixdate
        "%A, %d-%b-%y %H:%M:%S GMT",  # RFC 850
        "%a %b %e %H:%M:%S %Y",  # asctime: no zone, UTC
        "%a, %d %b %Y %H:%M:%S -0000",  # RFC 5322's zone of a UTC time
    )]
    assert [retry_after_seconds(form, now=NOW) for form in forms] == [30.0] * 4


@pytest.mark.parametrize("value", [
    "Mon, 99 Foo 2027 07:00:00 GMT",  # no such day or month
    "Tue, 15 Jan 2027 25:00:00 GMT",  # no such hour
    "Tue, 15 Jan 2027 07:00:00 GMT" + " " * 40 + "x",  # longer than any date
])
def test_a_date_that_cannot_be_read_is_one_second(value: str) -> None:
    assert retry_after_seconds(value, now=NOW) == 1.0


def test_the_wall_clock_is_the_default_now() -> None:
    forty_seconds_on = email.utils.formatdate(time.time() + 40, usegmt=True)  # to the second
    assert 30.0 <= retry_after_seconds(forty_seconds_on) <= 40.0
