package lifetime

import (
	"fmt"

	"github.com/gograph/gograph/internal/schedule"
)

// ReuseSampleEntries is TransformerEngine's reorganisation of an _order's
// sample entries for _reuse_graph_input_output_buffers: walking the
// schedule, each forward queues its passes per chunk; a chunk's backward
// entry marks the passes of its oldest queued microbatch consumed (their
// static inputs are free again), per sample key in forward order; and a
// forward whose key has a consumed pass takes that pass's entry (the oldest
// first). The result gives, per pass, the pass whose entry it becomes (itself
// when none), resolved through earlier reuses: a caller's list then holds
// one entry per slot, and the samples no pass keeps are free before warmup.
//
// With chain (chain_buffers), a chunk's later layer whose key equals the
// previous layer's reads that layer's output in place and no sample: it
// takes the entry of its microbatch's previous layer and plays no part in
// the reuse (had its graph to read a sample after all, the capture planner
// gives it a buffer of its own, as for any sample two live passes share).
//
// keys[pass] identifies what must be equal for two entries to be one (the
// leaves' shapes, dtypes and layouts, and, unlike TransformerEngine's key,
// requires_grad and strides: an entry is never replaced by one a graph
// would read differently).
//
// chained[pass] says that the pass took its entry by chaining: its sample
// args, not its keyword args (a mask or a scale can differ between layers
// in flight together), are its microbatch's previous layer's.
func ReuseSampleEntries(p *schedule.Plan, keys []int, chain bool) (entry []int, chained []bool, err error) {
	if !p.Ordered {
		return nil, nil, fmt.Errorf("sample entries are reorganised only for an _order schedule")
	}
	if len(keys) != p.Passes {
		return nil, nil, fmt.Errorf("%d sample keys for %d passes", len(keys), p.Passes)
	}
	entry = make([]int, p.Passes)
	chained = make([]bool, p.Passes)
	for i := range entry {
		entry[i] = i
	}
	queued := map[int][][]int{} // chunk -> per queued microbatch, its passes that hold an entry
	consumed := map[int][]int{} // key -> passes whose backward ran, oldest first
	lastEntry, prev := -1, -1
	for _, s := range p.Steps {
		switch s.Kind {
		case schedule.Forward:
			if s.Entry != lastEntry {
				lastEntry = s.Entry
				queued[s.Chunk] = append(queued[s.Chunk], nil)
			}
			if chain && s.Layer > 0 && keys[s.Pass] == keys[prev] {
				entry[s.Pass], chained[s.Pass] = entry[prev], true
				prev = s.Pass
				continue
			}
			q := queued[s.Chunk]
			q[len(q)-1] = append(q[len(q)-1], s.Pass)
			if free := consumed[keys[s.Pass]]; len(free) > 0 {
				entry[s.Pass] = entry[free[0]]
				consumed[keys[s.Pass]] = free[1:]
			}
			prev = s.Pass
		case schedule.Backward:
			if s.Entry == lastEntry {
				continue // one backward entry consumes its chunk's oldest microbatch once
			}
			lastEntry = s.Entry
			q := queued[s.Chunk]
			if len(q) == 0 {
				continue
			}
			for _, pass := range q[0] {
				consumed[keys[pass]] = append(consumed[keys[pass]], pass)
			}
			queued[s.Chunk] = q[1:]
		}
	}
	return entry, chained, nil
}
