"""The project's own decoder as an engine (drafter/decode/speculate.py, in this process): the reference every
served figure is checked against, and the only engine for a target that fits here."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from common.errors import InternalError
from common.paths import PROFILE_DIR
from drafter.decode.evaluation import NEAR_TIE_SHARE, OnlineResult, evaluate_online
from engines.protocol import Job, Measurement
from serving.profile import Profile, load_profile

STALE = 0.10  # a host profile that mis-projects what this host measures by more than this is stale


def host_profile() -> Profile | None:
    """This host's measured profile (configs/profiles/host.yaml), if there is one."""
    return load_profile("host") if (PROFILE_DIR / "host.yaml").is_file() else None


def in_process_version() -> str:
    import torch
    import transformers

    return f"torch {torch.__version__}, transformers {transformers.__version__}"


@dataclass
class InProcessRun:
    """The decoding trace as a Measurement; its metrics also say how this host's own profile projects it."""

    online: OnlineResult
    engine: str = "in-process"
    engine_version: str = field(default_factory=in_process_version)
    aux: dict | None = None
    endpoint: str = ""
    attested: bool = True
    display: str = "in-process"  # how the version page names the engine
    title_suffix: str = ""  # figure titles name only a serving engine
    host: Profile | None = field(default_factory=host_profile)  # read once, when the run is measured
    _figures: dict = field(default_factory=dict, repr=False)  # metrics per profile: the bootstrap runs once

    @property
    def per_prompt(self) -> list[tuple[int, int]]:
        return self.online.per_prompt

    @property
    def acc_pos(self) -> list[float]:
        return self.online.acc_pos

    @property
    def accept_len(self) -> float:
        return self.online.accept_len

    @property
    def accepted(self) -> list[list[int]]:
        return self.online.accepted

    @property
    def outputs(self) -> list[list[int]]:
        return self.online.outputs

    @property
    def histograms(self) -> list[tuple[int, ...]]:
        """Each prompt's verify-step histogram, counted from its decoding trace (serving/acceptance.py)."""
        from serving.acceptance import from_trace

        return [from_trace(a, self.online.k).steps for a in self.online.accepted]

    def metrics(self, profile: Profile) -> dict[str, float]:
        key = (profile.name, profile.digest, profile.draft_shape, profile.draft_method)
        if key not in self._figures:
            self._figures[key] = self.online.metrics(profile, self.host)
        return dict(self._figures[key])  # a copy: callers add their own figures to it

    def artifacts(self) -> dict[str, Any]:
        return {}

    def warnings(self, profile: Profile) -> list[str]:
        out = []
        if self.online.truncated:
            out.append(f"{self.online.truncated} prompts were cut from the left to fit the target context")
        m = self.metrics(profile)
        if "host_projection_error" in m and abs(m["host_projection_error"]) > STALE:
            out.append(
                f"profile 'host' projects a {m['host_speedup_projected']:.2f}x speed-up here, measured "
                f"{m['host_speedup']:.2f}x ({100 * m['host_projection_error']:+.0f}%): the profile is stale; "
                "rerun `python -m bench.host_profile`"
            )
        return out


class InProcess:
    """Speculative decoding against the loaded target, timed against the target alone."""

    name = "in-process"

    def __init__(self, target: Any, drafter: Any) -> None:
        self.target, self.drafter = target, drafter

    def check_reachable(self) -> None:
        return None

    def measure(self, job: Job, reference: Measurement | None = None) -> InProcessRun:
        online = evaluate_online(
            self.target, self.drafter, job.records, job.k, job.max_new_tokens, job.temperature, job.seed, job.progress
        )
        if online.mismatches:
            raise InternalError(
                f"greedy speculative output differed from the target's on {online.mismatches} "
                "prompts: a decoding bug, not a drafter property"
            )
        if online.near_ties > max(1.0, NEAR_TIE_SHARE * online.num_prompts):  # one is rounding on any count
            raise InternalError(
                f"greedy speculative output left the target's own at near-ties on {online.near_ties} of "
                f"{online.num_prompts} prompts (at most {100 * NEAR_TIE_SHARE:g}% is rounding): a decoding bug, "
                "not a drafter property"
            )
        if online.near_ties:
            print(
                f"evaluate: {online.near_ties} of {online.num_prompts} prompts' greedy speculative output left the "
                f"target's own at a near-tie of its {self.target.model.dtype} arithmetic (logit gap <= "
                f"{online.tie_gap:.3g}): a verify block rounds otherwise than one token at a time"
            )
        from drafter.methods import folder_method_or_default

        host = host_profile()  # this host's cycle, for the drafter's own method
        method = folder_method_or_default(job.folder)
        return InProcessRun(online, host=host.shaped(method.SHAPE, method.NAME) if host else None)
