"""bico.torch.options: what transfer_model is asked to do, one dataclass
per route family, its defaults in one place.

    import bico.torch as bt
    bt.transfer_model(A, A_ft, B, batches, method="fit",
                      options=bt.FitOptions(ridge=0.1, alpha="heldout"),
                      loss_fn=loss_fn)

  TransferOptions  what every route takes: the scale (alpha) and the
                   held-out choice (holdout, alpha_grid), threads
  MapOptions       the library's maps (methods bico, bico-in, bico-out,
                   gradfix, naive, pad): which modules pair, how fused
                   projections split, the blocks' depth map, GradFix's
                   votes, the library's own options (library=)
  FitOptions       the sequential fit (fit, proxy-fit): MapOptions' fields
                   (BiCo carries what the fit does not) and the ridge
  DistillOptions   the distillation (distill, proxy-distill)

options_for(method, **fields) makes the family's object for a method and
names the family that holds a field given to the wrong one.  A field's
meaning is documented at bico.torch.transfer_model."""
import dataclasses
from dataclasses import dataclass, field

from .._enums import METHODS as _C_METHODS
from .._status import BicoError, E_ARG

__all__ = ["TransferOptions", "MapOptions", "FitOptions", "DistillOptions",
           "options_for", "family_of", "FAMILIES"]


@dataclass
class TransferOptions(object):
    """alpha: a number > 0, "heldout", "match" or "entropy" (None: the
    route's default, "heldout" where a held-out loss exists); holdout:
    which calibration batches the held-out choice holds out (None:
    bico.torch.choose.HOLDOUT, an eighth; a share in (0, 1), or a list of
    batches); alpha_grid: the candidate scales (numbers >= 0; None:
    bico.torch.choose.ALPHA_GRID); threads: the
    library's and torch's threads (None: torch's current count)."""
    alpha: object = None
    holdout: object = None
    alpha_grid: object = None
    threads: object = None


@dataclass
class MapOptions(TransferOptions):
    """modules: the module names to carry (None: every Linear and the
    norms and embeddings the collector finds); split: fused projections'
    split; ties: modules sharing a map; norm_map: "act" (default) or
    "weight"; source_blocks / target_blocks: each model's block names for
    the depth map; votes: GradFix's votes (collected when None);
    gradfix_mode: "majority" or "mean"; library: the library's options by
    name (rank_tol, null, center, whiten, ...: transfer_state_dict's)."""
    modules: object = None
    split: object = None
    ties: object = None
    norm_map: str = "act"
    source_blocks: object = None
    target_blocks: object = None
    votes: object = None
    gradfix_mode: str = "majority"
    library: dict = field(default_factory=dict)


@dataclass
class FitOptions(MapOptions):
    """ridge: c > 0, a list of them (chosen on the held-out batches), or
    "gcv"; ridge_prior: "zero" or "bico"; general_batches: general text
    whose inputs weigh the ridge; tied: "carry" or "fit"; shared_out:
    modules whose outputs are the same classes on both sides;
    proxy_steps: proxy-fit's steps."""
    ridge: object = 1e-2
    ridge_prior: str = "zero"
    general_batches: object = None
    tied: str = "carry"
    shared_out: tuple = ()
    proxy_steps: int = 8


@dataclass
class DistillOptions(TransferOptions):
    """steps, lr, every (held-out checks), rank (LoRA factors; None:
    every weight), augment ("auto", "none", or a function of a batch)."""
    steps: object = None
    lr: object = None
    every: int = 25
    rank: object = None
    augment: object = "auto"


# method -> its family: the library's methods (its enumeration's names)
# take MapOptions
FAMILIES = dict({m: MapOptions for m in _C_METHODS},
                **{"fit": FitOptions, "proxy-fit": FitOptions,
                   "distill": DistillOptions,
                   "proxy-distill": DistillOptions})


def family_of(method):
    """The options class of a method (BicoError for an unknown one)."""
    if method not in FAMILIES:
        raise BicoError(E_ARG, "transfer_model: unknown method %r (known: "
                        "%s)" % (method, ", ".join(FAMILIES)))
    return FAMILIES[method]


def _fields(cls):
    return [f.name for f in dataclasses.fields(cls)]


def options_for(method, **fields):
    """The family's options of method with fields set; a field of another
    family is refused, naming the family and methods that take it."""
    cls = family_of(method)
    own = set(_fields(cls))
    for k in fields:
        if k not in own:
            homes = sorted({c.__name__ for c in FAMILIES.values()
                            if k in _fields(c)})
            raise BicoError(E_ARG, "transfer_model: %s is not an option of "
                            "method %r (%s)%s" % (
                                k, method, cls.__name__,
                                "; it is %s's (methods %s)" % (
                                    " and ".join(homes), ", ".join(
                                        m for m, c in FAMILIES.items()
                                        if k in _fields(c)))
                                if homes else ""))
    return cls(**fields)


def resolve(method, options):
    """options as the family's object for method: None (the defaults), a
    dict of fields, or an object of the family (a subclass included)."""
    cls = family_of(method)
    if options is None:
        return cls()
    if isinstance(options, dict):
        return options_for(method, **options)
    if not isinstance(options, cls):
        raise BicoError(E_ARG, "transfer_model: method %r takes %s, got %s"
                        % (method, cls.__name__, type(options).__name__))
    if isinstance(options, MapOptions) and \
            not isinstance(options.library, dict):
        raise BicoError(E_ARG, "transfer_model: library must be a dict of "
                        "the library's options, got %s"
                        % type(options.library).__name__)
    return options


def flat(options):
    """{field: value} of an options object, the values as they are (not
    copied)."""
    return {f.name: getattr(options, f.name)
            for f in dataclasses.fields(options)}
