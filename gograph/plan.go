package gograph

// The planning surface: TransformerEngine's pipeline schedule (_order) and
// buffer reuse, decided in Go once per make_graphed_callables. Plans cross
// as compact text (gopy passes no slices or maps); their formats are in
// docs/CORE_API.md. Validation errors contain "invalid schedule:", which
// Python raises as ValueError.

import (
	"fmt"

	"github.com/gograph/gograph/internal/lifetime"
	"github.com/gograph/gograph/internal/schedule"
)

// PlanSchedule validates a pipeline schedule and expands it into the
// warmup/capture steps, returned in schedule's text form.
//
// order is _order with its entries joined by commas ("1,2,-2,-1.5"), or ""
// for the default schedule (forwards 0..n-1, then, when training, backwards
// n-1..0). layers is _num_layers_per_chunk: "" when not given, "*L" for one
// integer, or "L1,L2,...". numCallables and numSamples are len(callables)
// and len(sample_args); training says whether backward steps run;
// warmupIters is num_warmup_iters.
func PlanSchedule(order, layers string, numCallables, numSamples int, training bool, warmupIters int) (plan string, err error) {
	defer recoverPanic("plan_schedule", &err)
	var p *schedule.Plan
	if order == "" {
		if layers != "" {
			return "", fmt.Errorf("plan_schedule: %w: _num_layers_per_chunk needs _order", schedule.ErrInvalid)
		}
		if numSamples != numCallables {
			return "", fmt.Errorf("plan_schedule: %w: expected sample_args to have the same length as callables, but got %d sample_args for %d callables", schedule.ErrInvalid, numSamples, numCallables)
		}
		p, err = schedule.Default(numCallables, training)
	} else {
		var entries []schedule.Entry
		entries, err = schedule.ParseOrder(order)
		if err != nil {
			return "", fmt.Errorf("plan_schedule: %w", err)
		}
		spec := schedule.Spec{Order: entries, NumCallables: numCallables, NumSamples: numSamples, Training: training, WarmupIters: warmupIters}
		spec.Layers, spec.LayersScalar, err = schedule.ParseLayers(layers)
		if err != nil {
			return "", fmt.Errorf("plan_schedule: %w", err)
		}
		p, err = schedule.Build(spec)
	}
	if err != nil {
		return "", fmt.Errorf("plan_schedule: %w", err)
	}
	return p.Encode(), nil
}

// PlanBuffers plans the static buffers of the passes of plan (PlanSchedule's
// text): which slot buffers share a slot and after which step each pool
// buffer can be released, with per-signature counts against
// TransformerEngine's FIFO scheme. buffers has one line per buffer,
// "R pass sig" (R: i input, g grad output, o output, d input grad, p cloned
// parameter grad), and optionally "k pass inputKey gradKey" lines with a
// pass's TransformerEngine reuse keys.
func PlanBuffers(plan, buffers string) (assignment string, err error) {
	defer recoverPanic("plan_buffers", &err)
	p, err := schedule.Decode(plan)
	if err != nil {
		return "", fmt.Errorf("plan_buffers: %w", err)
	}
	bufs, keys, err := lifetime.ParseBuffers(buffers, p.Passes)
	if err != nil {
		return "", fmt.Errorf("plan_buffers: %w", err)
	}
	r, err := lifetime.Assign(p, bufs, keys)
	if err != nil {
		return "", fmt.Errorf("plan_buffers: %w", err)
	}
	return r.Encode(bufs), nil
}
