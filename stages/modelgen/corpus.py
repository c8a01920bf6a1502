"""A deterministic text corpus for training the tokenizer, generated locally.

The text depends only on the constants in this file and on `_SplitMix64`, a fixed integer PRNG, so it is
byte-identical on every machine and every Python version: nothing is read from disk or the network, and
`random` (whose algorithms may change between versions) is not used.
"""

from collections.abc import Iterator

_COMMON = (
    "the of and to a in is it you that he was for on are with as his they be at one have this from or had by "
    "not word but what some we can out other were all there when up use your how said an each she which do "
    "their time if will way about many then them write would like so these her long make thing see him two "
    "has look more day could go come did number sound no most people my over know water than call first who "
    "may down side been now find any new work part take get place made live where after back little only "
    "round man year came show every good me give our under name very through just form sentence great think "
    "say help low line differ turn cause much mean before move right boy old too same tell does set three "
    "want air well also play small end put home read hand port large spell add even land here must big high "
    "such follow act why ask men change went light kind off need house picture try us again animal point "
    "mother world near build self earth father head stand own page should country found answer school grow "
    "study still learn plant cover food sun four between state keep eye never last let thought city tree "
    "cross farm hard start might story saw far sea draw left late run while press close night real life few "
    "north open seem together next white children begin got walk example ease paper group always music those "
    "both mark often letter until mile river car feet care second book carry took science eat room friend "
    "began idea fish mountain stop once base hear horse cut sure watch color face wood main enough plain girl "
    "usual young ready above ever red list though feel talk bird soon body dog family direct pose leave song "
    "measure door product black short numeral class wind question happen complete ship area half rock order "
    "fire south problem piece told knew pass since top whole king space heard best hour better true during "
    "hundred five remember step early hold west ground interest reach fast verb sing listen six table travel "
    "less morning ten simple several vowel toward war lay against pattern slow center love person money serve "
    "appear road map rain rule govern pull cold notice voice unit power town fine certain fly fall lead cry "
    "dark machine note wait plan figure star box noun field rest correct able pound done beauty drive stood "
    "contain front teach week final gave green quick develop ocean warm free minute strong special mind behind "
    "clear tail produce fact street inch multiply nothing course stay wheel full force blue object decide "
    "surface deep moon island foot system busy test record boat common gold possible plane age dry wonder "
    "laugh thousand ago ran check game shape equate hot miss brought heat snow tire bring yes distant fill "
    "east paint language among image describe model token server request cache prefill decode encode vision "
    "text assistant user system photo camera cat dog street sign sky cloud building window red green blue"
).split()

_ONSETS = "b c d f g h j k l m n p r s t v w z br ch cl cr dr fl gr pl pr sh st th tr qu".split()
_VOWELS = "a e i o u ai ea ee ie oo ou y".split()
_CODAS = ["", "", "", "n", "r", "s", "t", "l", "m", "nd", "st", "ng", "ck", "rt", "x"]
_ROLES = ["user\n", "assistant\n", "system\n", "USER: ", "ASSISTANT: "]
_PUNCT = [".", ",", "?", "!", ";", ":", " -", "'s", ")", "\n", ".\n\n"]


class _SplitMix64:
    """A tiny PRNG with a fixed definition (SplitMix64), independent of Python's `random`."""

    def __init__(self, seed: int) -> None:
        self.state = seed & 0xFFFFFFFFFFFFFFFF

    def next(self) -> int:
        self.state = (self.state + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
        return z ^ (z >> 31)

    def below(self, n: int) -> int:
        return self.next() % n

    def pick(self, items):
        return items[self.below(len(items))]


def _pseudo_word(rng: _SplitMix64) -> str:
    syllables = 1 + rng.below(3)
    return "".join(rng.pick(_ONSETS) + rng.pick(_VOWELS) + rng.pick(_CODAS) for _ in range(syllables))


def _word(rng: _SplitMix64, invented: list[str]) -> str:
    z = rng.next()  # one draw decides the kind of word, which one, and its case
    roll, pick, case = z % 100, (z >> 8) % 1_000_003, (z >> 40) % 12
    if roll < 50:
        word = _COMMON[pick % len(_COMMON)]
    elif roll < 93:
        word = invented[pick % len(invented)]
    elif roll < 98:
        word = str(pick % 10 ** (1 + case % 4))
    else:
        word = _pseudo_word(rng)
    return word.capitalize() if case == 0 else word


def sentences(n_words: int, n_invented: int, seed: int = 20240601) -> Iterator[str]:
    """Yield lines of pseudo-English totalling about `n_words` words.

    `n_invented` invented words recur with the common English ones, so BPE finds that many more merges
    worth learning (a larger tokenizer needs a larger `n_invented`).
    """
    rng = _SplitMix64(seed)
    invented = [_pseudo_word(rng) for _ in range(n_invented)]
    written = 0
    while written < n_words:
        length = 4 + rng.below(16)
        words = [_word(rng, invented) for _ in range(length)]
        words[0] = words[0].capitalize()
        head = rng.pick(_ROLES) if rng.below(8) == 0 else ""  # chat-template fragments
        yield head + " ".join(words) + rng.pick(_PUNCT)
        written += length
