import kvtier


def test_check_value():
    assert kvtier.crc32c(b"123456789") == 0xE3069283
