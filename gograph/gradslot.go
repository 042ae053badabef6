package gograph

// The grad-slot policy (internal/gradslot): what a parameter's .grad (or
// .main_grad) gets when a backward or weight-gradient graph hands it a
// gradient, as one table Python reads once and executes.

import (
	"github.com/gograph/gograph/internal/gradslot"
	"github.com/gograph/gograph/internal/wire"
)

// GradSlotPolicy returns the grad-slot policy: a "gradslot v1" header, then
// every row of gradslot.Encode's table (the hand-out of backward and
// weight-gradient graphs, the sweep that learns how a caller treats its
// grads, and what a weight-gradient capture makes of each slot).
func GradSlotPolicy() (table string, err error) {
	defer recoverPanic("grad_slot_policy", &err)
	return wire.GradSlots.Header() + gradslot.Encode(), nil
}
