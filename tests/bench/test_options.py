"""bench.options: the one parser of the benchmarks' comma-list options (bench.decode, bench.gpu_decode)."""
import pytest

from bench.options import MAX_BATCH, batch_sizes, comma_list
from core.errors import UsageError


def test_a_comma_list_keeps_known_items_in_order_and_falls_back_to_its_default():
    assert comma_list(" 8M, 1M ,", "--sizes", ("1M", "8M")) == ["8M", "1M"]
    assert comma_list(None, "--sizes", ("1M", "8M"), default=["1M"]) == ["1M"]
    assert batch_sizes("1, 8") == [1, 8]
    assert batch_sizes(None, default=["1"]) == [1]


@pytest.mark.parametrize("call, message", [
    (lambda: comma_list("1M,9T", "--sizes", ("1M", "8M"), "size"),
     "--sizes '1M,9T': expected a comma list of 1M, 8M, found unknown size 9T; pass e.g. --sizes 1M,8M"),
    (lambda: comma_list(",", "--dtypes", ("fp32",), "dtype"),
     "--dtypes ',': expected a comma list of fp32, found nothing; pass e.g. --dtypes fp32"),
    (lambda: batch_sizes("0,x"),
     f"--batches '0,x': expected a comma list of batch sizes in [1, {MAX_BATCH}], found 0, x; pass e.g. --batches 1,8"),
    (lambda: batch_sizes(f"{MAX_BATCH + 1}"), f"found {MAX_BATCH + 1};"),
])
def test_a_bad_list_is_one_usage_line_naming_the_option(call, message):
    with pytest.raises(UsageError) as e:
        call()
    assert message in str(e.value) and e.value.exit_code == 2
