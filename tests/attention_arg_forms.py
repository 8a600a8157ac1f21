"""Bad argument forms that both attention front ends (torch and JAX) parse in
Python, through symheap/_attention_args.py, with the same messages:
(keyword arguments, the message's pattern)."""

BAD_FORMS = [
    (dict(window_size=5), "window_size must be a pair"),
    (dict(dropout_p=0.1, seed=(1, 2, 3)), r"seed must be an int or a \(seed, offset\) pair"),
    (dict(dropout_p=0.1, seed=-1), r"seed must be in \[0, 2\*\*64\)"),
    (dict(dropout_p=0.1, seed=(1, 2 ** 32)), r"offset must be in \[0, 2\*\*32\)"),
    (dict(dropout_p=0.1, seed=True), "seed must be an int, got bool"),
    (dict(dropout_p=0.1, seed=1.5), "seed must be an int, got float"),
]
