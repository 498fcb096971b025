//! The per-sequence work of a job: a leader's lane inserts its flushed tokens, selects and
//! plans; a follower's lane appends its flush to its history and rewrites the pages its
//! leader's insert changed.

use std::time::Instant;

use half::f16;

use super::{secs, Elem, Flush, FollowerLane, Geometry, HostBuf, LanePlan, LeaderLane};
use crate::error::{ensure, Error, Result};
use crate::load::LoadPlan;
use crate::pages::{self, HeadForest, PageFormat, Stores};
use crate::select::SelectParams;

/// What a leader's lane did: its plan, and the seconds spent inserting and selecting.
pub(super) struct LeaderWork {
    pub plan: LanePlan,
    pub insert_s: f64,
    pub select_s: f64,
}

/// Inserts, selects and plans for one leader sequence.
pub(super) fn leader_lane(
    g: &Geometry,
    lane: &LeaderLane,
    q: &[f32],
    select: SelectParams,
    reselect: bool,
) -> Result<LeaderWork> {
    let h = g.heads;
    let width = select.max_pages;
    let capacity = lane.resident.read().map_err(|_| poisoned())?.capacity();
    let nothing = || LanePlan {
        plan: LoadPlan { table: vec![-1; h * width], ..LoadPlan::default() },
        table_len: vec![0; h * width],
        selected: vec![-1; h * width],
        changed: vec![Vec::new(); h],
        capacity,
        ..LanePlan::default()
    };
    let Some(lane_forest) = &lane.forest else {
        ensure!(lane.flush.is_none(), "tokens were flushed into a sequence that has no index yet");
        return Ok(LeaderWork { plan: nothing(), insert_s: 0.0, select_s: 0.0 });
    };
    if !reselect && lane.flush.is_none() {
        return Ok(LeaderWork { plan: nothing(), insert_s: 0.0, select_s: 0.0 });
    }
    let t = Instant::now();
    let mut changed = vec![Vec::new(); h];
    if let Some(flush) = &lane.flush {
        let mut forest = lane_forest.write().map_err(|_| poisoned())?;
        check_store_dims(g, &forest)?;
        let pages = insert_flush(g, &mut forest, flush, lane.k_store, lane.v_store)?;
        let mut resident = lane.resident.write().map_err(|_| poisoned())?;
        for (head, pages) in pages.into_iter().enumerate() {
            let ids: Vec<i64> = pages.iter().map(|&p| p as i64).collect();
            resident.invalidate(head, &ids)?;
            changed[head] = pages
                .into_iter()
                .map(|p| Ok((p, forest.page_tokens(head, p as usize)?.to_vec())))
                .collect::<Result<_>>()?;
        }
    }
    let insert_s = secs(t);
    let t = Instant::now();
    let forest = lane_forest.read().map_err(|_| poisoned())?;
    check_store_dims(g, &forest)?;
    let (pages, counts) = if forest.max_pages() <= width {
        // Everything fits: every page, no search (and exact).
        let mut pages = vec![-1i32; h * width];
        let mut counts = vec![0i32; h];
        for head in 0..h {
            let n = forest.num_pages(head)?;
            for (p, o) in pages[head * width..head * width + n].iter_mut().enumerate() {
                *o = p as i32;
            }
            counts[head] = n as i32;
        }
        (pages, counts)
    } else {
        // An 8-bit forest's keys are its K store's rows.
        let k_codes = match g.format {
            PageFormat::Native => None,
            PageFormat::Int8 | PageFormat::K8V4 => Some(lane.k_store.slice::<u8>("k_store")?),
        };
        forest.select(q, select, k_codes)?
    };
    let plan = lane.resident.write().map_err(|_| poisoned())?.plan(&pages, &counts)?;
    let len =
        |head: i32, page: i32| -> Result<i32> { Ok(forest.page_tokens(head as usize, page as usize)?.len() as i32) };
    let load_len = plan.heads.iter().zip(&plan.pages).map(|(&hd, &p)| len(hd, p)).collect::<Result<Vec<_>>>()?;
    let mut table_len = vec![0i32; h * width];
    for (i, (&p, tl)) in pages.iter().zip(table_len.iter_mut()).enumerate() {
        if p >= 0 {
            *tl = len((i / width) as i32, p)?;
        }
    }
    let plan = LanePlan { plan, load_len, table_len, selected: pages, changed, capacity };
    Ok(LeaderWork { plan, insert_s, select_s: secs(t) })
}

pub(super) fn poisoned() -> Error {
    Error::Invalid("an earlier failure left this layer's index unusable; reset the cache".into())
}

fn check_store_dims(g: &Geometry, forest: &HeadForest) -> Result<()> {
    ensure!(
        forest.num_heads() == g.heads && forest.dim() == g.dim && forest.page_size() == g.page_size,
        "the index has {} heads of dim {} with pages of {}, the job {} / {} / {}",
        forest.num_heads(),
        forest.dim(),
        forest.page_size(),
        g.heads,
        g.dim,
        g.page_size
    );
    Ok(())
}

/// A lane's page stores as the job's page format holds them, with elements `T`.
fn stores_of<'a, T: pages::Elem>(g: &Geometry, k_store: &'a HostBuf, v_store: &'a HostBuf) -> Result<Stores<'a, T>> {
    Ok(match g.format {
        PageFormat::Native => Stores::Native(k_store.slice_mut::<T>("k_store")?, v_store.slice_mut::<T>("v_store")?),
        PageFormat::Int8 => Stores::Int8(k_store.slice_mut::<u8>("k_store")?, v_store.slice_mut::<u8>("v_store")?),
        PageFormat::K8V4 => Stores::K8V4(k_store.slice_mut::<u8>("k_store")?, v_store.slice_mut::<u8>("v_store")?),
    })
}

/// `forest.insert` of a lane's flush; returns the changed pages per head.
fn insert_flush(
    g: &Geometry,
    forest: &mut HeadForest,
    flush: &Flush,
    k_store: HostBuf,
    v_store: HostBuf,
) -> Result<Vec<Vec<u32>>> {
    match g.elem {
        Elem::F32 => insert_flush_as::<f32>(g, forest, flush, k_store, v_store),
        Elem::F16 => insert_flush_as::<f16>(g, forest, flush, k_store, v_store),
        Elem::Bf16 => insert_flush_as::<u16>(g, forest, flush, k_store, v_store),
    }
}

fn insert_flush_as<T: pages::Elem>(
    g: &Geometry,
    forest: &mut HeadForest,
    flush: &Flush,
    k_store: HostBuf,
    v_store: HostBuf,
) -> Result<Vec<Vec<u32>>> {
    let want = g.heads * flush.tokens * g.dim;
    let k = flush.keys.slice::<T>("flushed keys")?;
    let v = flush.values.slice::<T>("flushed values")?;
    ensure!(
        k.len() == want && v.len() == want,
        "flushed keys/values must be [{}, {}, {}]",
        g.heads,
        flush.tokens,
        g.dim
    );
    forest.insert(k, v, stores_of::<T>(g, &k_store, &v_store)?)
}

/// A follower sequence: appends the flush to its history and rewrites the pages its leader's
/// insert changed, from the history (8-bit pages quantise the rows).
pub(super) fn follow_lane(g: &Geometry, lane: &FollowerLane, lead: &LanePlan) -> Result<()> {
    match g.elem {
        Elem::F32 => follow_lane_as::<f32>(g, lane, lead),
        Elem::F16 => follow_lane_as::<f16>(g, lane, lead),
        Elem::Bf16 => follow_lane_as::<u16>(g, lane, lead),
    }
}

fn follow_lane_as<T: pages::Elem>(g: &Geometry, lane: &FollowerLane, lead: &LanePlan) -> Result<()> {
    let d = g.dim;
    let hk = lane.k_history.slice_mut::<T>("k_history")?;
    let hv = lane.v_history.slice_mut::<T>("v_history")?;
    ensure!(
        hk.len() == hv.len() && hk.len() % (g.heads * d) == 0,
        "histories must both be [{}, n, {}]",
        g.heads,
        g.dim
    );
    let cap = hk.len() / (g.heads * d);
    ensure!(lane.history_len <= cap, "history_len {} exceeds the history's {cap} tokens", lane.history_len);
    if let Some(f) = &lane.flush {
        let (k, v) = (f.keys.slice::<T>("flushed keys")?, f.values.slice::<T>("flushed values")?);
        ensure!(
            k.len() == g.heads * f.tokens * d && v.len() == k.len(),
            "flushed keys/values must be [{}, {}, {}]",
            g.heads,
            f.tokens,
            g.dim
        );
        ensure!(
            f.tokens <= lane.history_len,
            "history_len {} is below the {} flushed tokens",
            lane.history_len,
            f.tokens
        );
        let at = lane.history_len - f.tokens;
        for head in 0..g.heads {
            let dst = (head * cap + at) * d;
            let src = head * f.tokens * d;
            hk[dst..dst + f.tokens * d].copy_from_slice(&k[src..src + f.tokens * d]);
            hv[dst..dst + f.tokens * d].copy_from_slice(&v[src..src + f.tokens * d]);
        }
    }
    let p = super::staging::store_pages(g, lane.k_store.len(), lane.v_store.len())?;
    let mut stores = stores_of::<T>(g, &lane.k_store, &lane.v_store)?;
    for (head, pages) in lead.changed.iter().enumerate() {
        for (page, tokens) in pages {
            ensure!((*page as usize) < p, "page {page} beyond the store's {p} pages");
            let rows = tokens
                .iter()
                .map(|&t| {
                    ensure!((t as usize) < lane.history_len, "token {t} is not in the history ({})", lane.history_len);
                    let src = (head * cap + t as usize) * d;
                    Ok((&hk[src..src + d], &hv[src..src + d]))
                })
                .collect::<Result<Vec<_>>>()?;
            stores.rewrite_page(head * p + *page as usize, &rows, g.page_size, d)?;
        }
    }
    Ok(())
}
