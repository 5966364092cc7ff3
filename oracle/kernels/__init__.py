"""The planner's numba kernels: the bagpipe rules of docs/design.md#the-planner compiled per key, and the
reading of a batch that every mode shares.

Same structure as the specification (tests/oracle/reference_planner.py, steps a-f), with the
slow parts replaced by indexable state:

* keys: every key read and not yet planned to its last use has an *entry*, found through a
  hash index (`intmap.IntMap`). A key with copies always has one, since a copy stays only
  while some trainer uses its key in the window. The entry holds the version of the key's
  last planned write-back and its *records*: one per trainer that holds a copy of the key
  or has an unplanned use of it, ascending by trainer, with the copy's slot and the
  iteration of the trainer's earliest unplanned use (``head``, NEVER if none). A trainer
  with neither has no record, so a key costs what it has, whatever T is (`records`). A key
  whose entry is gone keeps its index cell, which then holds that version until no fetch
  can need it (`intmap.reserve_index`): one lookup when a key comes and one when it goes;
* next uses: every (key, trainer) *pair* read but not yet planned is an occurrence in a ring
  that knows its key's entry and, once the pair is read again, that next occurrence's
  iteration. The pair's record holds its latest occurrence (``tail``), so reading a batch
  links each pair (`ingest`), and planning moves each pair's head (`plan`), without a hash
  lookup per pair;
* copies: each slot holds its key, its entry, its trainer's next use of the key (NEVER if
  none is read yet) and when it was last used or filled (`copies`);
* free slots: one min-heap per trainer (the smallest free slot is handed out; `heaps`);
* Belady victims: per trainer that must evict at x, its copies not used at x in buckets by
  next use (one pass over its slots counts them; only the first buckets are then ordered,
  by a counting sort over two bytes a slot), each bucket made a heap only when
  victims are taken from it (`heaps`).

Everything is sized by the caches (T x C) or by the keys and pairs in the window, and the
index also by the keys whose last write-back may still be in flight (`state`); nothing by T
per key. The kernels append
events to preallocated arrays and return counts; oracle/planner.py turns them into
directives.

The files, each importing only those above it:

* `cache`: where a kernel is cached (below, "Cache"; the machinery is `common.jit`);
* `layout`: the names of the columns and cells of the state and event arrays, and NEVER;
* `intmap`: the hash map (the planner's index, and the tables that read a batch);
* `batch`: a global batch read into its sorted distinct (key, trainer) pairs (`read_pairs`,
  every mode);
* `state`: the planner's state and the event buffers: made, and grown between batches;
* `records`: entries and their records in the state's store: homes, blocks, free lists;
* `heaps`: free slots and victims;
* `copies`: a copy comes and goes; the events the planning steps emit;
* `ingest`: batch z read into the window (`ingest`);
* `plan`: iteration x planned (`plan_iteration`, the bagpipe rules' steps a-f);
* `merge`, `parts`: the directives' lists, merged from key partitions (`merge_runs`) and cut
  per trainer from an iteration's events (`rows_by_group`, `split_groups`; every mode).

oracle/bagpipe.py calls `ingest` and `plan_iteration` behind the `Rules` interface; oracle/planner.py
and oracle/parts.py call `parts` and `merge`.

Speed. Planning is bound by memory latency and by numba's reference counting. The cells of a
slot, and those of an entry, sit side by side. numba increfs and decrefs an array (atomic
calls, tens of ns each, more than the work around them) whenever code takes it out of a
tuple, and every array of a tuple passed to a function, inlined or not. So each step of
planning is one function, called once per iteration, that takes the state's arrays out once;
the helpers it calls per key or per pair take arrays, never the state, and are inlined
(`jit.inlined`, numba's ``inline="always"``). A slice or a view costs the same: hot code
indexes cells one at a time. The per-key loops prefetch the entries of the keys a few steps
ahead, the cache lines each step reads (`records.prefetch_entry`), and the blocks of those
nearer, once their entries are in, every line of a block; the per-pair loops prefetch the
slot of the pair a few steps ahead, where its slot is known (hits are stamped in a pass of
their own for that). That second stage reads the entry, and stalls the loop
if it has not arrived, so it is left out where no key can have a block (T <= HOME_RECORDS).
Entries and records are aligned to cache lines (`state.aligned_empty`): an entry is three
lines, its cells, its home and its leavers' cells. Where a helper or a constant sits makes
no difference to the code: numba inlines a helper of another file, and compiles in a
constant of another file, as it does one of its own.

Cache. numba's on-disk cache notices only edits to a kernel's own file, while these kernels
inline helpers and read constants of other files. So each kernel is cached in a folder
named by a hash of all the files of this package and of `common.cpu_prefetch` (LLVM's
prefetch instruction, which numba lacks, and which the trainer's kernels use too; `cache`,
`common.jit`): after an edit to any of them, every kernel is compiled afresh on its first
call, and `common.jit.is_cached` (oracle/compiled.py's
`is_compiled`) says so until then. oracle/compiled.py compiles them before the oracle
reports ready. tests/oracle/test_compiled.py edits a copy of this package and sees the
kernel of another file compiled again.
"""
