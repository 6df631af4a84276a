"""The dense-vs-paged KV cache experiment, its report and plots."""
