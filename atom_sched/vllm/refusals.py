"""What atom_sched's vLLM scheduler class refuses, and how it says so."""


class UnsupportedFeature(NotImplementedError):
    """A vLLM feature this scheduler class does not serve (yet)."""


def refuse(feature: str, hint: str) -> UnsupportedFeature:
    return UnsupportedFeature(
        f"atom_sched.vllm.AtomScheduler does not support {feature} yet; {hint}"
    )
