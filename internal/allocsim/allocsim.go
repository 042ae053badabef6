// Package allocsim models one pool of PyTorch's CUDA caching allocator
// (c10/cuda/CUDACachingAllocator.cpp, native backend, no expandable
// segments, default settings), so the planner can predict what a graph
// pool will reserve from the allocations a capture would make, without a
// GPU.
//
// The rules modelled: sizes round up to 512 B; requests up to 1 MiB come
// from the small pool, in 2 MiB segments; larger ones from the large pool,
// in 20 MiB segments below 10 MiB and otherwise in a segment of the
// request rounded up to 2 MiB; a request takes the best-fitting free block
// (smallest size, then lowest address; a newer segment lies lower), split when the rest is at least
// 512 B (small) or more than 1 MiB (large); a freed block merges with free
// neighbours of its segment. Segments are never released (a graph pool's
// are not while its graphs live). Streams, events and garbage collection
// are not modelled: one capture stream allocates everything.
package allocsim

import (
	"fmt"
	"sort"
)

// Allocator constants of c10/cuda/CUDACachingAllocator.cpp.
const (
	MinBlockSize  = 512      // kMinBlockSize: every block size is a multiple
	SmallSize     = 1 << 20  // kSmallSize: the largest small-pool request
	SmallBuffer   = 2 << 20  // kSmallBuffer: a small-pool segment
	MinLargeAlloc = 10 << 20 // kMinLargeAlloc: below it a large request gets a LargeBuffer segment
	RoundLarge    = 2 << 20  // kRoundLarge: larger segments round up to it
	LargeBuffer   = 20 << 20 // kLargeBuffer
)

// RoundSize is the block size of a request of n bytes.
func RoundSize(n int64) int64 {
	if n < MinBlockSize {
		return MinBlockSize
	}
	return MinBlockSize * ((n + MinBlockSize - 1) / MinBlockSize)
}

// SegmentSize is the size of the segment allocated for a rounded request
// that no free block fits.
func SegmentSize(size int64) int64 {
	switch {
	case size <= SmallSize:
		return SmallBuffer
	case size < MinLargeAlloc:
		return LargeBuffer
	default:
		return RoundLarge * ((size + RoundLarge - 1) / RoundLarge)
	}
}

// block is a range of one segment.
type block struct {
	seg, offset, size int64
	free              bool
	prev, next        *block
	small             bool
}

// less orders blocks as the allocator's (size, address) sets do. Addresses
// are modelled as cudaMalloc hands them out on Linux: each new segment
// below the previous ones (on the H200, a pool's segments sorted by
// address are in reverse creation order), blocks by offset within one.
func (b *block) less(o *block) bool {
	if b.size != o.size {
		return b.size < o.size
	}
	if b.seg != o.seg {
		return b.seg > o.seg
	}
	return b.offset < o.offset
}

// Pool is one allocator pool: its segments, the blocks handed out, and the
// high-water marks of both.
type Pool struct {
	segments      int64
	released      int64 // segments ReleaseCached gave back
	reserved      int64
	allocated     int64
	peakReserved  int64
	peakAllocated int64
	live          map[int]*block
	freeSmall     []*block
	freeLarge     []*block
}

// New returns an empty pool.
func New() *Pool { return &Pool{live: map[int]*block{}} }

// Reserved is the sum of the pool's segment sizes.
func (p *Pool) Reserved() int64 { return p.reserved }

// Allocated is the sum of the sizes of the blocks handed out.
func (p *Pool) Allocated() int64 { return p.allocated }

// PeakReserved and PeakAllocated are the high-water marks since New.
func (p *Pool) PeakReserved() int64  { return p.peakReserved }
func (p *Pool) PeakAllocated() int64 { return p.peakAllocated }

// Segments is how many segments the pool allocated (those given back
// included).
func (p *Pool) Segments() int64 { return p.segments }

// Live reports whether id names a block handed out and not freed.
func (p *Pool) Live(id int) bool { _, ok := p.live[id]; return ok }

// Size is the rounded size of the live block id (0 when not live).
func (p *Pool) Size(id int) int64 {
	if b, ok := p.live[id]; ok {
		return b.size
	}
	return 0
}

// Where is the segment and offset of the live block id (ok false when not
// live): equal places mean one storage, as equal data pointers do.
func (p *Pool) Where(id int) (seg, offset int64, ok bool) {
	b, ok := p.live[id]
	if !ok {
		return 0, 0, false
	}
	return b.seg, b.offset, true
}

// FreeBlock is a free block: its segment, offset and size, and whether it is
// in the small pool (only requests up to SmallSize take it, whatever its size).
type FreeBlock struct {
	Seg, Offset, Size int64
	Small             bool
}

// FreeRanges lists the pool's free blocks, in no particular order: the
// memory a request may be given now.
func (p *Pool) FreeRanges() []FreeBlock {
	out := make([]FreeBlock, 0, len(p.freeSmall)+len(p.freeLarge))
	for _, list := range [][]*block{p.freeSmall, p.freeLarge} {
		for _, b := range list {
			out = append(out, FreeBlock{b.seg, b.offset, b.size, b.small})
		}
	}
	return out
}

// SegmentSizes lists the segments' sizes in creation order (0 for one
// ReleaseCached gave back).
func (p *Pool) SegmentSizes() []int64 {
	sizes := make([]int64, p.segments)
	seen := map[*block]bool{}
	visit := func(b *block) {
		for b.prev != nil {
			b = b.prev
		}
		if seen[b] {
			return
		}
		seen[b] = true
		var n int64
		for x := b; x != nil; x = x.next {
			n += x.size
		}
		sizes[b.seg] = n
	}
	for _, b := range p.live {
		visit(b)
	}
	for _, b := range p.freeSmall {
		visit(b)
	}
	for _, b := range p.freeLarge {
		visit(b)
	}
	return sizes
}

// Alloc hands out a block of n bytes under id, which must not be live.
func (p *Pool) Alloc(id int, n int64) error {
	if n < 0 {
		return fmt.Errorf("allocsim: allocation %d of %d bytes", id, n)
	}
	if _, ok := p.live[id]; ok {
		return fmt.Errorf("allocsim: allocation %d is already live", id)
	}
	size := RoundSize(n)
	small := size <= SmallSize
	b := p.takeFree(size, small)
	if b == nil {
		seg := SegmentSize(size)
		b = &block{seg: p.segments, size: seg, small: small}
		p.segments++
		p.reserved += seg
		p.peakReserved = max(p.peakReserved, p.reserved)
	}
	if rest := b.size - size; (small && rest >= MinBlockSize) || (!small && rest > SmallSize) {
		tail := &block{seg: b.seg, offset: b.offset + size, size: rest, free: true, prev: b, next: b.next, small: small}
		if b.next != nil {
			b.next.prev = tail
		}
		b.next, b.size = tail, size
		p.insertFree(tail)
	}
	b.free = false
	p.live[id] = b
	p.allocated += b.size
	p.peakAllocated = max(p.peakAllocated, p.allocated)
	return nil
}

// seedID names the block Seed allocates and frees; trace ids are never
// negative.
const seedID = -1 << 62

// Seed carves one segment for a request of n bytes and frees it at once, as
// allocating and freeing one tensor of n bytes does before any other request:
// later requests split their blocks out of that free segment, and freed
// neighbours inside it merge again, which blocks of different segments never
// do. The allocated high-water mark does not count it.
func (p *Pool) Seed(n int64) error {
	if err := p.Alloc(seedID, n); err != nil {
		return err
	}
	if err := p.Free(seedID); err != nil {
		return err
	}
	p.peakAllocated = p.allocated
	return nil
}

// ReleaseCached gives back every segment that is one free block, as
// torch.cuda.empty_cache() does for a pool that no graph holds.
func (p *Pool) ReleaseCached() {
	for _, small := range []bool{true, false} {
		list := p.freeList(small)
		kept := (*list)[:0]
		for _, b := range *list {
			if b.prev == nil && b.next == nil {
				p.reserved -= b.size
				p.released++
				continue
			}
			kept = append(kept, b)
		}
		*list = kept
	}
}

// Free returns block id to the pool, merging it with free neighbours.
func (p *Pool) Free(id int) error {
	b, ok := p.live[id]
	if !ok {
		return fmt.Errorf("allocsim: free of allocation %d, which is not live", id)
	}
	delete(p.live, id)
	p.allocated -= b.size
	b.free = true
	if n := b.next; n != nil && n.free {
		p.removeFree(n)
		absorb(b, n)
	}
	if q := b.prev; q != nil && q.free {
		p.removeFree(q)
		absorb(q, b)
		b = q
	}
	p.insertFree(b)
	return nil
}

// absorb merges block n into its predecessor b.
func absorb(b, n *block) {
	b.size += n.size
	b.next = n.next
	if n.next != nil {
		n.next.prev = b
	}
}

func (p *Pool) freeList(small bool) *[]*block {
	if small {
		return &p.freeSmall
	}
	return &p.freeLarge
}

// takeFree removes and returns the best-fitting free block (nil if none).
func (p *Pool) takeFree(size int64, small bool) *block {
	list := p.freeList(small)
	i := sort.Search(len(*list), func(i int) bool { return (*list)[i].size >= size })
	if i == len(*list) {
		return nil
	}
	b := (*list)[i]
	*list = append((*list)[:i], (*list)[i+1:]...)
	return b
}

func (p *Pool) insertFree(b *block) {
	list := p.freeList(b.small)
	i := sort.Search(len(*list), func(i int) bool { return !(*list)[i].less(b) })
	*list = append(*list, nil)
	copy((*list)[i+1:], (*list)[i:])
	(*list)[i] = b
}

func (p *Pool) removeFree(b *block) {
	list := p.freeList(b.small)
	i := sort.Search(len(*list), func(i int) bool { return !(*list)[i].less(b) })
	for ; i < len(*list); i++ {
		if (*list)[i] == b {
			*list = append((*list)[:i], (*list)[i+1:]...)
			return
		}
	}
	panic("allocsim: a free block missing from its free list")
}
