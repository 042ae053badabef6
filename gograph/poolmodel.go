package gograph

// The pool model: the eager engine's running model of CUDA's graph pools
// (internal/poolmodel), held by handle from PoolModelNew to PoolModelDrop.
// The engine reports its captures' allocations and frees as they happen
// and reads where each block would be and what is free. Formats are in
// docs/CORE_API.md.

import (
	"fmt"
	"strings"

	"github.com/gograph/gograph/internal/poolmodel"
)

var models = poolmodel.NewStore()

// PoolModelNew returns the handle of a new, empty pool model.
func PoolModelNew() int64 { return models.New() }

// PoolModelApply runs events on model ("a ID BYTES POOL" an allocation,
// "f ID" a free, one per line) and returns "ID START END" per allocation.
func PoolModelApply(model int64, events string) (placements string, err error) {
	defer recoverPanic("pool_model_apply", &err)
	err = models.With(model, func(m *poolmodel.Model) error {
		placements, err = m.Apply(events)
		return err
	})
	return placements, opErr("pool_model_apply", err)
}

// PoolModelFreeRanges returns pool's free memory in model as "START END
// SMALL" lines, sorted (SMALL 1 for a small-pool block, which only requests
// up to 1 MiB take).
func PoolModelFreeRanges(model int64, pool string) (ranges string, err error) {
	defer recoverPanic("pool_model_free_ranges", &err)
	var b strings.Builder
	err = models.With(model, func(m *poolmodel.Model) error {
		for _, r := range m.FreeRanges(pool) {
			fmt.Fprintf(&b, "%d %d %d\n", r.Start, r.End, map[bool]int{false: 0, true: 1}[r.Small])
		}
		return nil
	})
	return b.String(), opErr("pool_model_free_ranges", err)
}

// PoolModelDrop forgets model; it reports whether the handle was known.
func PoolModelDrop(model int64) (known bool, err error) {
	defer recoverPanic("pool_model_drop", &err)
	return models.Drop(model), nil
}

// LivePoolModels returns how many pool models are held (a leak check).
func LivePoolModels() int { return models.Live() }
